"""Bitwise searches over the float order (jvllm/sample/order_search.py) against numpy's sort."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jvllm.sample.order_search import from_order_key, kth_largest, lowest_with_mass_above_below, order_keys

SPECIAL = np.array([-np.inf, -3.4e38, -1.0, -1e-30, -1e-45, -0.0, 0.0, 1e-45, 1e-30, 1.0, 3.4e38, np.inf],
                   np.float32)


def test_order_keys_sort_as_the_floats_and_invert():
    rng = np.random.default_rng(0)
    x = np.concatenate([SPECIAL, rng.normal(0, 10, 500).astype(np.float32),
                        rng.normal(0, 1e-38, 100).astype(np.float32)])  # subnormals too
    keys = np.asarray(jax.jit(order_keys)(x))
    order = np.argsort(x, kind="stable")
    assert np.all(np.diff(keys[order].astype(np.int64)) >= 0)
    assert keys[5] < keys[6]  # -0.0 below +0.0, both equal as floats
    np.testing.assert_array_equal(np.asarray(jax.jit(from_order_key)(keys)).view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("vocab", [1, 7, 1000])
def test_kth_largest_equals_the_sorted_rows_kth(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.normal(0, 2, (6, vocab)).astype(np.float32)
    x[0, : vocab // 2] = -np.inf
    x[1] = np.round(x[1])  # many ties
    k = rng.integers(1, vocab + 1, 6).astype(np.int32)
    got = np.asarray(jax.jit(lambda x, k: kth_largest(order_keys(x), k))(x, k))
    np.testing.assert_array_equal(got, np.sort(x, axis=-1)[np.arange(6), vocab - k])


@pytest.mark.parametrize("mass", [0.05, 0.5, 0.9, 0.99])
def test_lowest_with_mass_above_below_equals_a_cumulative_sum_over_sorted_rows(mass):
    rng = np.random.default_rng(int(mass * 100))
    x = rng.normal(0, 1.5, (5, 800)).astype(np.float32)
    x[2, 300:500] = x[2, 0]  # a tie group
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    got = np.asarray(jax.jit(lambda x, p, m: lowest_with_mass_above_below(order_keys(x), p, m))(
        x, probs, np.full(5, mass, np.float32)))
    for r in range(5):
        order = np.argsort(-x[r], kind="stable")
        above = np.cumsum(probs[r, order].astype(np.float64)) - probs[r, order]  # mass before each token
        expected = x[r, order][np.nonzero(above < mass)[0][-1]]
        assert got[r] == expected, (r, got[r], expected)


def test_a_row_without_enough_mass_anywhere_keeps_everything():
    x = np.zeros((1, 4), np.float32)
    probs = np.full((1, 4), 0.2, np.float32)  # sums to 0.8 < 0.9
    got = np.asarray(jax.jit(lambda x, p, m: lowest_with_mass_above_below(order_keys(x), p, m))(
        x, probs, np.full(1, 0.9, np.float32)))
    assert got[0] == -np.inf
