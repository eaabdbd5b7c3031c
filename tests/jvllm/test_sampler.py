"""Tests for the on-device sampler and the host-side sampling-tensor builder."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.sample.logprobs import logprob_stats
from jvllm.sampling_params import SamplingParams
from jvllm.sample.sampler import (RowSpec, SamplerFlags, blocked_row_argmax, build_sampling_tensors, process_logits,
                                  row_argmax, sample)
from jvllm.sample.tensors import empty_masks, pack_token_bits

sample_jit = jax.jit(sample, static_argnames=("flags",))
process_logits_jit = jax.jit(process_logits, static_argnames=("flags",))

V = 64  # vocab size for the non-statistical tests

# Fixed 8-token distribution for the statistical tests; deliberately unsorted so
# the sort-based truncation is exercised.
_BASE_PROBS = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02])
_PERM = np.array([5, 2, 7, 0, 3, 6, 1, 4])
PROBS = _BASE_PROBS[_PERM]  # [8] float64
N_DRAWS = 8192


def params(**kw: Any) -> SimpleNamespace:
    """A SamplingParams stand-in with vLLM defaults."""
    base = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
        allowed_token_ids=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def row(p: SimpleNamespace, seed: int = 0, position: int = 0, prompt=(), output=(), blocked=()) -> RowSpec:
    return RowSpec(p, seed, position, list(prompt), list(output), list(blocked))


HISTORY = 64  # token history width of the penalty tests (longer than any prompt + output here)


def force_all_features(t, flags: SamplerFlags, vocab: int):
    """The same step with every feature switched on (history, addend, random, truncation), values unchanged."""
    t = dataclasses.replace(t, any_random=np.asarray(True), any_top_k_p=np.asarray(True))
    if t.history is None:
        t.history, t.num_prompt = np.full((len(t.seeds), HISTORY), -1, np.int32), np.zeros(len(t.seeds), np.int32)
    if t.allowed_bits is None:
        t.allowed_bits, t.bias_ids, t.bias_values = empty_masks(len(t.seeds), vocab)
    return t, SamplerFlags(penalties=True, masks=True)


def run(logits: np.ndarray, rows: list[RowSpec], pad: int | None = None, force: bool = False):
    """Builds tensors, optionally forces every feature on, pads logits and samples."""
    pad = len(rows) if pad is None else pad
    t, flags = build_sampling_tensors(rows, pad, vocab_size=logits.shape[1], history_width=HISTORY)
    if force:
        t, flags = force_all_features(t, flags, logits.shape[1])
    full = np.zeros((pad, logits.shape[1]), np.float32)  # [S, V] float32
    full[: len(rows)] = logits
    ids = sample_jit(full, t, flags)
    # The engine's logprob of a sampled token, for requests that ask: under the raw (unprocessed) logits.
    lps = _raw_logprob(full, ids)
    return np.asarray(ids)[: len(rows)], np.asarray(lps)[: len(rows)], t, flags


@jax.jit
def _raw_logprob(logits: jax.Array, ids: jax.Array) -> jax.Array:
    return logprob_stats(logits, ids, 0).target_logprob  # [S] float32


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---------------------------------------------------------------- greedy


def test_greedy_argmax_and_raw_logprob():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, V)).astype(np.float32) * 3  # [5, V] float32
    rows = [row(params(temperature=0.0)) for _ in range(4)] + [row(SamplingParams(temperature=1e-6))]  # -> 0
    ids, lps, t, flags = run(logits, rows, pad=8)
    assert not t.any_random and not t.any_top_k_p and flags == SamplerFlags()
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    expect = log_softmax(logits.astype(np.float64))[np.arange(5), ids]
    np.testing.assert_allclose(lps, expect, atol=1e-5)


@pytest.mark.parametrize("argmax", [row_argmax, blocked_row_argmax], ids=["row_argmax", "blocked"])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 127, 128, 300, 49152])
def test_row_argmax_matches_numpy_first_index(vocab, argmax):
    """The argmax (native on XLA CPU with the kernels, else blocked) and its blocked jnp form: ties resolve to the
    first index, -inf, +inf and NaN rows as numpy, any vocab size (whole vectors of 16 and a tail)."""
    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(8, vocab)).astype(np.float32)  # [8, V] float32
    x[1] = np.round(x[1])  # many ties at the maximum
    x[2, :] = -np.inf  # fully masked row
    x[3, vocab // 2] = np.nan
    x[4, -1] = 50.0  # maximum in the last (possibly partial) block
    x[5, :] = 7.0  # every entry tied
    x[6, 0], x[6, -1] = -np.inf, np.inf  # both infinities in one block (its sum is NaN, it holds no NaN)
    x[7, -1], x[7, 0] = -np.inf, np.inf  # ... after an earlier +inf
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), x.argmax(-1))


def test_row_argmax_is_one_native_pass_on_cpu_and_jnp_for_gpus():
    """On XLA CPU with the native kernels the argmax lowers to the kernel; lowered for CUDA, to the blocked jnp."""
    from cpu_kernels.build import available

    x = jax.ShapeDtypeStruct((4, 300), jnp.float32)
    cpu = jax.jit(row_argmax).trace(x).lower(lowering_platforms=("cpu",)).as_text()
    cuda = jax.jit(row_argmax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert ("jvllm_row_argmax" in cpu) == (available() and jax.default_backend() == "cpu")
    assert "jvllm_row_argmax" not in cuda and "reduce" in cuda


# ---------------------------------------------------------------- statistics


def empirical(p: SimpleNamespace, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Frequencies of N_DRAWS draws from PROBS (one row per position, one call)."""
    logits = np.log(PROBS).astype(np.float32)[None].repeat(N_DRAWS, 0)  # [N, 8] float32
    rows = [row(p, seed=seed, position=i) for i in range(N_DRAWS)]
    ids, lps, _, _ = run(logits, rows)
    # Returned logprob is always under the raw distribution.
    np.testing.assert_allclose(lps, np.log(PROBS)[ids], atol=1e-5)
    return np.bincount(ids, minlength=8) / N_DRAWS, ids


def renorm(keep: np.ndarray, probs: np.ndarray = PROBS) -> np.ndarray:
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def kept_top(n: int) -> np.ndarray:
    """Mask of the n most likely tokens of PROBS."""
    keep = np.zeros(8, bool)
    keep[np.argsort(-PROBS)[:n]] = True
    return keep


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(), PROBS),
        (dict(temperature=0.5), renorm(np.ones(8, bool), PROBS**2)),
        (dict(top_k=3), renorm(kept_top(3))),
        # cumulative sorted mass 0.3, 0.5, 0.65 -> 3 tokens reach 0.6
        (dict(top_p=0.6), renorm(kept_top(3))),
        # threshold 0.2 * 0.3 = 0.06 keeps the 6 tokens with p >= 0.07
        (dict(min_p=0.2), renorm(kept_top(6))),
        # top-k=5 then top-p=0.7 of the renormalized 5 (0.3/0.87, ...) -> 3 tokens
        (dict(top_k=5, top_p=0.7), renorm(kept_top(3))),
    ],
    ids=["plain", "temp0.5", "top_k3", "top_p0.6", "min_p0.2", "top_k5_top_p0.7"],
)
def test_sampling_distribution(kw, expected):
    freq, _ = empirical(params(**kw))
    assert np.abs(freq - expected).max() < 0.02, (freq, expected)
    # Tokens removed by truncation are never drawn.
    assert np.all(freq[expected == 0] == 0)


def test_allowed_ids_distribution():
    allowed = [1, 3, 4]
    freq, ids = empirical(params(allowed_token_ids=allowed))
    assert set(np.unique(ids)) <= set(allowed)
    keep = np.isin(np.arange(8), allowed)
    assert np.abs(freq - renorm(keep)).max() < 0.02


def test_different_seeds_differ():
    _, a = empirical(params(), seed=1)
    _, b = empirical(params(), seed=2)
    assert (a != b).mean() > 0.3


# ---------------------------------------------------------------- determinism


def _target_row() -> RowSpec:
    return row(params(temperature=0.9, top_k=20, top_p=0.95), seed=1234, position=17)


def _other_rows(rng: np.random.Generator, n: int) -> list[RowSpec]:
    kinds = [
        params(temperature=0.0),
        params(temperature=1.3),
        params(temperature=0.7, min_p=0.1, presence_penalty=0.5),
        params(temperature=1.0, repetition_penalty=1.3, logit_bias={3: 5.0}),
        params(temperature=0.0, frequency_penalty=0.4, allowed_token_ids=[1, 2, 3]),
    ]
    return [
        row(kinds[i % len(kinds)], seed=int(rng.integers(1 << 31)), position=int(rng.integers(100)),
            prompt=rng.integers(0, V, 5), output=rng.integers(0, V, int(rng.integers(0, 9))),
            blocked=[0] if i % 3 == 0 else [])
        for i in range(n)
    ]


def test_seeded_row_independent_of_batch():
    rng = np.random.default_rng(1)
    target_logits = rng.normal(size=(V,)).astype(np.float32) * 2  # [V] float32
    # Several positions so a coincidental match is unlikely.
    alone = []
    for pos in range(6):
        r = dataclasses.replace(_target_row(), position=pos)
        ids, lps, _, _ = run(target_logits[None], [r])
        alone.append((int(ids[0]), float(lps[0])))
    assert len({a for a, _ in alone}) > 1

    for pad in (16, 32):
        for index in (0, 7, 15):
            others = _other_rows(rng, 16)
            others_logits = rng.normal(size=(16, V)).astype(np.float32)
            for pos in range(6):
                rows = list(others)
                rows[index] = dataclasses.replace(_target_row(), position=pos)
                logits = others_logits.copy()
                logits[index] = target_logits
                ids, lps, _, flags = run(logits, rows, pad=pad)
                assert flags.penalties and flags.masks
                assert int(ids[index]) == alone[pos][0]
                assert abs(float(lps[index]) - alone[pos][1]) < 1e-6


# ---------------------------------------------------------------- processors vs numpy


def ref_process(logits: np.ndarray, rows: list[RowSpec]) -> np.ndarray:
    """Straightforward numpy reference of penalties, bias, blocked and allowed."""
    out = logits.astype(np.float64).copy()
    for i, r in enumerate(rows):
        p = r.params
        x = out[i]
        counts = np.bincount(np.asarray(r.output_ids, int), minlength=V)
        seen = counts > 0
        seen[np.asarray(r.prompt_ids, int)] = True
        rp = p.repetition_penalty
        x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
        x -= p.frequency_penalty * counts
        x -= p.presence_penalty * (counts > 0)
        for tok, b in (p.logit_bias or {}).items():
            x[int(tok)] += b
        x[np.asarray(r.blocked_ids, int)] = -np.inf
        if p.allowed_token_ids:
            mask = np.ones(V, bool)
            mask[p.allowed_token_ids] = False
            x[mask] = -np.inf
    return out


def _processor_rows() -> list[RowSpec]:
    return [
        row(params(repetition_penalty=1.5), prompt=[1, 2, 3], output=[3, 4, 4]),
        row(params(frequency_penalty=0.7), prompt=[5], output=[6, 6, 6, 7]),
        row(params(presence_penalty=1.1), prompt=[5], output=[6, 6, 6, 7]),
        row(params(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.2),
            prompt=[9, 10], output=[10, 11, 11, 12, 13]),
        row(params(logit_bias={"8": 10.0, 9: -2.5})),
        row(params(allowed_token_ids=[4, 40, 63])),
        row(params(temperature=0.0), blocked=[int(i) for i in range(0, V, 2)]),
        row(params(logit_bias={0: 3.0}, allowed_token_ids=[0, 1], frequency_penalty=1.0),
            output=[1, 1], blocked=[1]),
        row(params()),  # untouched row
    ]


def test_process_logits_matches_numpy():
    rng = np.random.default_rng(2)
    rows = _processor_rows()
    logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 3  # [R, V] float32
    t, flags = build_sampling_tensors(rows, 16, vocab_size=V, history_width=HISTORY)
    assert flags.penalties and flags.masks
    full = np.zeros((16, V), np.float32)
    full[: len(rows)] = logits
    got = np.asarray(process_logits_jit(full, t, flags))[: len(rows)]
    expect = ref_process(logits, rows)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expect))
    finite = np.isfinite(expect)
    np.testing.assert_allclose(got[finite], expect[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[-1], logits[-1])  # no-feature row bit-identical
    # Features really change the greedy choice where expected.
    assert np.argmax(got[4]) == 8
    assert np.argmax(got[5]) in (4, 40, 63)
    assert np.argmax(got[6]) % 2 == 1
    assert np.argmax(got[7]) == 0


def test_greedy_sample_uses_processed_logits():
    rows = _processor_rows()
    for r in rows:
        r.params.temperature = 0.0
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 3
    ids, lps, _, _ = run(logits, rows, pad=16)
    np.testing.assert_array_equal(ids, ref_process(logits, rows).argmax(-1))
    np.testing.assert_allclose(lps, log_softmax(logits.astype(np.float64))[np.arange(len(rows)), ids], atol=1e-5)


def test_repetition_penalty_reduces_repeats():
    logits = np.zeros((1, V), np.float32)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.5
    no_pen, *_ = run(logits, [row(params(temperature=0.0), output=[5])])
    pen, *_ = run(logits, [row(params(temperature=0.0, repetition_penalty=2.0), output=[5])])
    assert no_pen[0] == 5 and pen[0] == 6


# ---------------------------------------------------------------- flag invariance


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_flags_on_do_not_change_plain_rows(temperature):
    rng = np.random.default_rng(4)
    rows = [row(params(temperature=temperature), seed=i, position=3 * i,
                prompt=rng.integers(0, V, 4), output=rng.integers(0, V, 3)) for i in range(12)]
    logits = rng.normal(size=(12, V)).astype(np.float32) * 2
    ids_min, lps_min, t, flags = run(logits, rows, pad=16)
    assert flags == SamplerFlags() and bool(t.any_random) == (temperature > 0) and not t.any_top_k_p
    ids_all, lps_all, *_ = run(logits, rows, pad=16, force=True)
    np.testing.assert_array_equal(ids_min, ids_all)
    np.testing.assert_array_equal(lps_min, lps_all)
    # Same with real feature rows mixed into the batch.
    mixed = rows + _other_rows(rng, 4)
    mixed_logits = np.concatenate([logits, rng.normal(size=(4, V)).astype(np.float32)])
    ids_mix, lps_mix, mt, mflags = run(mixed_logits, mixed, pad=16)
    assert mflags.penalties and mflags.masks and mt.any_top_k_p
    np.testing.assert_array_equal(ids_mix[:12], ids_min)
    np.testing.assert_array_equal(lps_mix[:12], lps_min)


# ---------------------------------------------------------------- builder


def test_builder_shapes_and_padding():
    rows = [
        row(params(temperature=0.0, top_k=5, top_p=0.5), prompt=range(5), output=range(3)),
        row(params(temperature=1.0, top_k=-1, logit_bias={1: 1.0, 2: 1.0, 3: 1.0}),
            seed=(1 << 40) + 9, position=11, prompt=range(2), output=range(5),
            blocked=[2, 3]),
    ]
    t, flags = build_sampling_tensors(rows, 4, vocab_size=V, history_width=HISTORY)
    # Greedy rows drop truncation params; top_k=-1 means disabled.
    assert flags == SamplerFlags(penalties=False, masks=True)
    assert bool(t.any_random) and not t.any_top_k_p and not t.any_logprobs
    assert t.history is None and t.allowed_bits.shape == (4, (V + 31) // 32) and t.allowed_bits.dtype == np.int32
    allowed = np.ones(V, bool)
    allowed[[2, 3]] = False
    np.testing.assert_array_equal(t.allowed_bits[1], pack_token_bits(allowed))
    assert (t.allowed_bits[[0, 2, 3]] == -1).all()  # rows without masks allow every token
    assert list(t.bias_ids[1, :4]) == [1, 2, 3, V] and list(t.bias_values[1, :4]) == [1.0, 1.0, 1.0, 0.0]
    assert (t.bias_ids[[0, 2, 3]] == V).all() and not t.bias_values[[0, 2, 3]].any()
    np.testing.assert_array_equal(np.asarray(t.top_k), [0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(t.temperature), [0.0, 1.0, 0.0, 0.0])
    assert int(t.seeds[1]) == 9 and t.seeds.dtype == np.uint32

    rows[0].params.repetition_penalty = 1.2
    t, flags = build_sampling_tensors(rows, 4, vocab_size=V, history_width=HISTORY)
    assert flags.penalties
    assert t.history.shape == (4, HISTORY) and list(t.num_prompt) == [5, 2, 0, 0]
    np.testing.assert_array_equal(t.history[0, :9], [0, 1, 2, 3, 4, 0, 1, 2, -1])
    np.testing.assert_array_equal(t.history[3], [-1] * HISTORY)

    with pytest.raises(ValueError):
        build_sampling_tensors(rows, 1, vocab_size=V, history_width=HISTORY)


def test_packed_bits_follow_llguidance_layout():
    """Token t is bit t % 32 of word t // 32, as llguidance fills its masks; a vocab that is not a multiple of 32
    leaves the last word's high bits clear."""
    allowed = np.zeros(70, bool)
    allowed[[0, 31, 32, 69]] = True
    bits = pack_token_bits(allowed)
    assert bits.dtype == np.int32 and bits.shape == (3,)
    assert [int(w) & 0xFFFFFFFF for w in bits] == [1 | 1 << 31, 1, 1 << 5]


def test_grammar_bits_intersect_other_masks_and_win_when_nothing_is_left():
    grammar = np.zeros(V, bool)
    grammar[[5, 6, 7]] = True
    rows = [row(params(allowed_token_ids=[6, 7, 8])), row(params(), blocked=[5, 6, 7])]
    for r in rows:
        r.grammar_bits = pack_token_bits(grammar)
    logits = np.random.default_rng(5).normal(size=(2, V)).astype(np.float32)
    t, flags = build_sampling_tensors(rows, 2, vocab_size=V, history_width=HISTORY)
    got = np.asarray(process_logits_jit(logits, t, flags))
    assert list(np.flatnonzero(np.isfinite(got[0]))) == [6, 7]
    assert list(np.flatnonzero(np.isfinite(got[1]))) == [5, 6, 7]  # min_tokens blocked the grammar's only way on


def test_top_k_at_or_past_the_vocab_keeps_every_token():
    """A top_k larger than any int32 (the server accepts any positive int) means no truncation, not an overflow."""
    rows = [row(params(top_k=2**70)), row(params(top_k=V)), row(params(top_k=-1)), row(params(top_k=3))]
    t, _ = build_sampling_tensors(rows, 4, vocab_size=V, history_width=HISTORY)
    assert t.top_k.tolist() == [0, 0, 0, 3]
