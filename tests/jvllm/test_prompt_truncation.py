"""SamplingParams' truncate_prompt_tokens (the prompt's last k tokens) and detokenize=False (token ids only) on
the default model, against the same prompts given as the kept token ids."""
from __future__ import annotations

import pytest

from jvllm import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because it wants to"


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **kwargs})


def test_truncation_keeps_the_last_tokens_and_generates_as_from_them(default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    assert len(ids) > 5
    (cut,) = default_engine.generate(PROMPT, greedy(truncate_prompt_tokens=5), use_tqdm=False)
    (from_ids,) = default_engine.generate({"prompt_token_ids": ids[-5:]}, greedy(), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.prompt == default_engine.tokenizer.decode(ids[-5:])
    assert cut.outputs[0].token_ids == from_ids.outputs[0].token_ids
    (whole,) = default_engine.generate(PROMPT, greedy(truncate_prompt_tokens=len(ids) + 3), use_tqdm=False)
    assert whole.prompt_token_ids == ids and whole.prompt == PROMPT  # shorter prompts are left as they are


def test_truncation_to_the_model_limit_lets_an_overlong_prompt_run(default_engine):
    limit = default_engine.config.max_model_len
    long_prompt = {"prompt_token_ids": [314] * (limit + 20)}
    with pytest.raises(ValueError, match="max_model_len"):
        default_engine.generate(long_prompt, greedy(), use_tqdm=False)
    (result,) = default_engine.generate(long_prompt, greedy(truncate_prompt_tokens=-1, max_tokens=1), use_tqdm=False)
    assert len(result.prompt_token_ids) == limit - 1 and len(result.outputs[0].token_ids) == 1


@pytest.mark.parametrize("value", [0, -2, 1.5, "3"])
def test_bad_truncation_values_are_refused(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)


def test_detokenize_false_gives_the_same_tokens_without_text(default_engine):
    (with_text,) = default_engine.generate(PROMPT, greedy(logprobs=1), use_tqdm=False)
    (ids_only,) = default_engine.generate(PROMPT, greedy(logprobs=1, detokenize=False), use_tqdm=False)
    assert with_text.outputs[0].text and ids_only.outputs[0].text == ""
    assert ids_only.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert len(ids_only.outputs[0].logprobs) == len(with_text.outputs[0].logprobs)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)
