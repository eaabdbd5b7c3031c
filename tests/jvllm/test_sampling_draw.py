"""The sampler's draw and truncation on vocabularies past its block and candidate sizes: draws follow the softmax,
never land on a token of zero probability, and the truncation thresholds, read from the largest logits or
searched over whole rows, equal those of fully sorted rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jvllm.sample.sampler import build_sampling_tensors, draw_from_logits
from tests.jvllm.test_sampler import HISTORY, params, row



@pytest.mark.parametrize("vocab", [8, 300, 1000])
def test_draws_follow_softmax_over_blocks(vocab):
    """Many uniforms through one row (vocab not a multiple of the block): frequencies match the softmax."""
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, 2, vocab).astype(np.float32)
    logits[rng.choice(vocab, vocab // 4, replace=False)] = -np.inf  # masked tokens: never drawn
    probs = np.exp(logits - logits[np.isfinite(logits)].max())
    probs /= probs.sum()
    n = 200_000
    uniforms = rng.random(n, dtype=np.float32)
    ids = np.asarray(jax.jit(draw_from_logits, static_argnames="block")(
        np.broadcast_to(logits, (n, vocab)), uniforms, np.full(n, -1, np.int32), block=16))
    freq = np.bincount(ids, minlength=vocab) / n
    assert np.all(freq[probs == 0] == 0)
    assert np.abs(freq - probs).max() < 5 * np.sqrt(probs.max() / n)


def test_draw_edges_never_pick_zero_mass_and_fall_back_on_rows_without_mass():
    vocab = 40
    logits = np.full((6, vocab), -np.inf, np.float32)
    logits[0, 37] = 1.0  # one token left, in the last (partial) block
    logits[1, 0] = logits[1, 39] = 0.0  # first and last token
    logits[2, 5:9] = 3.0  # uniform at 0 and just under 1 stay on these
    logits[3, 5:9] = 3.0
    logits[4, :] = np.nan  # no finite mass: the fallback
    # row 5: every token -inf: the fallback
    uniforms = np.array([0.5, 0.999, 0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 0.5], np.float32)
    fallback = np.arange(100, 106, dtype=np.int32)
    ids = np.asarray(jax.jit(draw_from_logits, static_argnames="block")(logits, uniforms, fallback, block=16))
    assert ids[0] == 37 and ids[1] == 39 and ids[2] == 5 and ids[3] == 8
    assert list(ids[4:]) == [104, 105]


def sorted_truncation(logits: np.ndarray, top_k, top_p, min_p) -> np.ndarray:
    """The reference: each filter's threshold read off the row sorted in descending order (float64 sums)."""
    out = np.empty_like(logits)
    for r, x in enumerate(logits):
        vocab, order = x.size, np.sort(x)[::-1].astype(np.float64)
        k = top_k[r] if 0 < top_k[r] < vocab else vocab
        thr_k = order[k - 1] if k < vocab else -np.inf
        weights = np.where(order >= thr_k, np.exp(order - order[0]), 0.0)
        probs = weights / weights.sum()
        keep = (np.cumsum(probs) - probs < top_p[r]) & (order >= thr_k)  # the mass above each token < p
        thr_p = order[max(keep.sum(), 1) - 1] if top_p[r] < 1 else -np.inf
        thr_m = order[0] + np.log(min_p[r]) if min_p[r] > 0 else -np.inf
        out[r] = np.where(x >= max(thr_k, thr_p, thr_m), x, -np.inf)
    return out


@pytest.mark.parametrize("spread", [8.0, 0.5], ids=["peaked", "flat"])
def test_truncation_from_the_largest_logits_equals_a_full_sort(spread, monkeypatch):
    """A vocabulary past sampler.CANDIDATES[0]: the kept tokens equal those of thresholds read off fully sorted
    rows, both where the head of largest logits holds every kept token (peaked rows) and where some row sends the
    step to the search over whole rows (flat rows, top-k past the head); and the search alone gives them too."""
    from jvllm.sample import sampler

    vocab = 1000
    rng = np.random.default_rng(3)
    kinds = [dict(top_k=5), dict(top_k=100, top_p=0.8), dict(top_p=0.5), dict(top_p=0.95, min_p=0.02),
             dict(min_p=0.1), dict(), dict(top_k=400) if spread < 1 else dict(top_k=200, top_p=0.99)]
    rows = [row(params(**kind)) for kind in kinds]
    t, _ = build_sampling_tensors(rows, len(rows), vocab_size=vocab, history_width=HISTORY)
    logits = (rng.normal(0, spread, (len(rows), vocab))).astype(np.float32)
    head = jax.lax.top_k(logits, sampler.CANDIDATES[0])[0]
    row_mass = np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
    _, complete = sampler._thresholds(head, t, vocab, row_mass)
    assert bool(np.all(complete)) == (spread > 1), complete  # peaked: the head alone; flat: the search
    expected = sorted_truncation(logits, np.asarray(t.top_k), np.asarray(t.top_p), np.asarray(t.min_p))
    from_head = np.asarray(jax.jit(sampler.apply_top_k_top_p_min_p)(logits, t))
    np.testing.assert_array_equal(from_head, expected)
    monkeypatch.setattr(sampler, "CANDIDATES", ())  # now every row is searched whole
    np.testing.assert_array_equal(np.asarray(jax.jit(sampler.apply_top_k_top_p_min_p)(logits, t)), expected)
    kept = np.isfinite(from_head).sum(-1)
    assert kept[0] == 5 and 1 <= kept[2] < vocab and kept[5] == vocab, kept


@pytest.mark.parametrize("num_rows", [3, 16, 24])
def test_searched_thresholds_on_masked_tied_and_flat_rows_equal_sorted_ones(num_rows, monkeypatch):
    """The search over whole rows, row counts that split into groups of the search (16, 24) or not (3): rows with
    most tokens masked to -inf, a long run of tied logits, top-k past the finite tokens and top-p near 1."""
    from jvllm.sample import sampler

    vocab = 3000
    rng = np.random.default_rng(num_rows)
    logits = rng.normal(0, rng.choice([0.3, 1.0, 4.0], (num_rows, 1)), (num_rows, vocab)).astype(np.float32)
    logits[0, :2900] = -np.inf
    logits[1, 100:400] = logits[1, 7]
    logits[-1, :] = np.float32(0.5)  # every token tied
    kinds = [dict(top_k=200, top_p=0.9), dict(top_p=0.7), dict(top_k=150, min_p=0.01), dict(top_p=0.999),
             dict(top_k=2999), dict(top_p=0.3, min_p=0.2), dict()]
    rows = [row(params(**kinds[i % len(kinds)])) for i in range(num_rows)]
    t, _ = build_sampling_tensors(rows, num_rows, vocab_size=vocab, history_width=HISTORY)
    monkeypatch.setattr(sampler, "CANDIDATES", ())
    got = np.asarray(jax.jit(sampler.apply_top_k_top_p_min_p)(logits, t))
    np.testing.assert_array_equal(
        got, sorted_truncation(logits, np.asarray(t.top_k), np.asarray(t.top_p), np.asarray(t.min_p)))
    assert np.isfinite(got[0]).sum() <= 100 and np.isfinite(got[-1]).all()


@pytest.mark.parametrize("length", [1, 100, 128, 129, 1000, 49152])
def test_prefix_sums_equal_a_cumulative_sum(length):
    from jvllm.sample.sampler import prefix_sums

    x = np.random.default_rng(length).random((3, length), dtype=np.float32)
    got = np.asarray(jax.jit(prefix_sums)(x))
    assert got.shape == x.shape
    np.testing.assert_allclose(got, np.cumsum(x.astype(np.float64), axis=-1), rtol=2e-6, atol=1e-6)


def test_row_uniforms_are_uniform_and_unrelated_across_seeds_and_positions():
    """1000 seeds x 1000 positions: the uniforms fill 100 equal bins evenly (chi-square far below its 0.1%
    bound), and neighbours along either key are uncorrelated."""
    from jvllm.sample.sampler import _row_uniforms

    seeds, positions = np.meshgrid(np.arange(1000, dtype=np.uint32), np.arange(1000, dtype=np.int32), indexing="ij")
    u = np.asarray(jax.jit(_row_uniforms)(seeds.ravel(), positions.ravel())).reshape(1000, 1000)
    assert u.min() >= 0 and u.max() < 1
    counts = np.bincount((u * 100).astype(int).ravel(), minlength=100)
    expected = u.size / 100
    assert ((counts - expected) ** 2 / expected).sum() < 149  # chi-square, 99 degrees of freedom, p = 0.001
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.005  # ~5 standard errors of 1e6 pairs
