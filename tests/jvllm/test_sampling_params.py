"""Tests for SamplingParams defaults, validation and normalization."""

from __future__ import annotations

import math

import pytest

from jvllm.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.logprobs is None
    assert p.prompt_logprobs is None
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.logit_bias is None
    assert p.allowed_token_ids is None
    assert p.temperature > 0


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(3)
    assert b.stop_token_ids == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", -1),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", 2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("seed", 1.5),
        ("seed", "42"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 1.5),
        ("prompt_logprobs", -1),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: "x"}),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", [(1, 2.0)]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", ["3"]),
    ],
)
def test_invalid_value_raises_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    # Without a max_tokens cap any min_tokens is fine.
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_error_message_names_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=2.0)
    with pytest.raises(ValueError, match=r"\[-2, 2\]"):
        SamplingParams(presence_penalty=3.0)


def test_boundary_values_accepted() -> None:
    p = SamplingParams(
        temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
        repetition_penalty=1e-3, max_tokens=1, logprobs=0, prompt_logprobs=0, seed=0,
    )
    assert p.max_tokens == 1 and p.logprobs == 0
    assert SamplingParams(top_p=1e-9).top_p == 1e-9
    assert SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(temperature=2).temperature == 2.0


def test_top_k_minus_one_normalized_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0


def test_stop_normalized_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []  # type: ignore[arg-type]


def test_logit_bias_keys_converted_and_values_clamped() -> None:
    p = SamplingParams(logit_bias={"12": 5, 7: -300.0, "3": 250})
    assert p.logit_bias == {12: 5.0, 7: -100.0, 3: 100.0}
    assert all(isinstance(k, int) for k in p.logit_bias)


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 9.9e-6])
def test_greedy_resets_truncation_filters(temperature: float) -> None:
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=10, min_p=0.2)
    assert p.temperature == 0.0
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_small_but_nongreedy_temperature_kept() -> None:
    p = SamplingParams(temperature=1e-4, top_k=10)
    assert p.temperature > 0
    assert p.top_k == 10


def test_clone_is_deep_and_equal() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={2: 1.0}, allowed_token_ids=[3])
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(9)
    q.logit_bias[5] = 2.0
    q.allowed_token_ids.append(4)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
    assert p.logit_bias == {2: 1.0} and p.allowed_token_ids == [3]


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


def test_validate_for_vocab() -> None:
    SamplingParams(stop_token_ids=[0, 9], logit_bias={9: 1.0}, allowed_token_ids=[9]).validate_for_vocab(10)
    for kwargs, name in [
        ({"stop_token_ids": [10]}, "stop_token_ids"),
        ({"logit_bias": {"10": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, 99]}, "allowed_token_ids"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs).validate_for_vocab(10)
