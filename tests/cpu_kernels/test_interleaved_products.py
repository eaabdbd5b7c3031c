"""Q8_0 / Q4_0 / Q4_1 weights interleaved by groups of 8 rows (models.quantized.interleave_rows, the native kernels' layout
on AVX2 builds: cpu_kernels/interleaved_products.h): the layout round trip, the products of both of its paths (row
chunks below the int16 tiles' row count, 16-bit code tiles from it) against gguf's reference dequantizer and
float64 products, each row's bits at every row count, the gated product, the 8-bit code tiles on request, and where
the layout is chosen."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import (gated_matmul, int8_tile_formats, interleaved_rows_preferred,
                                          quantized_matmul, word_groups_preferred)
from jvllm.model_loader.gguf_blocks import dequantize_blocks
from models.layers import Linear
from models.quantized import (INTERLEAVED, check_blocks, dequantize, interleave_rows, native_layout,
                              quantize_reference)

pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")

FORMATS = ["q8_0", "q4_0", "q4_1"]
# The row counts at which the paths meet, as on AVX2 builds (AVX-512 builds read the layout too, at any limits).
PATHS = dict(int16_max_rows=8, int16_tile_min_rows=64)


def weights(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Row-major blocks [n, row bytes] of random weights, rows scaled 10^-3 to 10 apart."""
    rng = np.random.default_rng(seed)
    row_scales = np.float32(10.0) ** rng.integers(-3, 2, size=(n, 1)).astype(np.float32)
    return quantize_reference(rng.standard_normal((n, k)).astype(np.float32) * row_scales, fmt)


def product(x: np.ndarray, raw: np.ndarray, fmt: str, **paths: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, **{**PATHS, **paths}))(x, raw))


def int16_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|error| bound of a product with x rounded to int16 per block of 32 (half a step of max |x| / 32767 each) and
    float32 sums: [M, N]."""
    step = np.repeat(np.abs(x).reshape(x.shape[0], -1, 32).max(axis=-1) / 32767.0, 32, axis=-1)  # [M, K]
    return (0.5 * step + 1e-6 * np.abs(x)).astype(np.float64) @ np.abs(w).astype(np.float64).T + 1e-30


@pytest.mark.parametrize("fmt", FORMATS)
def test_interleaving_keeps_every_weight(fmt):
    raw = weights(fmt, 24, 96, seed=1)
    interleaved = interleave_rows(raw, fmt)
    assert interleaved.shape == raw.shape and interleaved.dtype == np.uint8
    assert not np.array_equal(interleaved, raw)
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(interleaved), fmt + "x8", 96)),
                                  dequantize_blocks(raw, fmt))


# (m, n, k): row chunks (1-63 rows: partial chunks of 8, several chunks), the tiles (64+: a half tile of 8 columns
# where n is not a multiple of 16, K = 8,192 over several depth slices).
CASES = [(1, 8, 32), (3, 40, 576), (8, 16, 96), (9, 136, 96), (17, 40, 576), (63, 24, 64), (64, 40, 576),
         (130, 24, 96), (70, 16, 8192)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, n, k", CASES)
def test_product_matches_dequantize_then_float64_matmul(fmt, m, n, k):
    raw = weights(fmt, n, k, seed=m * 100 + n)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    w = dequantize_blocks(raw, fmt)
    got = product(x, interleave_rows(raw, fmt), fmt + "x8")
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.astype(np.float64).T), int16_bound(x, w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_gets_the_bits_it_gets_alone_below_the_tiles(fmt):
    """Rows of x take the same operations whatever rows come with them (up to the tiles' row count), so a
    verification step's rows give the decode steps' bits."""
    n, k = 48, 576
    raw = interleave_rows(weights(fmt, n, k, seed=5), fmt)
    x = np.random.default_rng(5).standard_normal((63, k)).astype(np.float32)
    alone = np.concatenate([product(x[i:i + 1], raw, fmt + "x8") for i in range(63)])
    for m in (2, 5, 8, 13, 63):
        np.testing.assert_array_equal(product(x[:m], raw, fmt + "x8"), alone[:m])


def test_gated_product_with_interleaved_weights():
    fmt, n, k = "q4_1", 40, 576
    gate, up = weights(fmt, n, k, seed=7), weights(fmt, n, k, seed=8)
    for m in (1, 8, 30, 70):
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        call = jax.jit(lambda a, b, c: gated_matmul(a, b, c, fmt + "x8", **PATHS))
        got = np.asarray(call(x, interleave_rows(gate, fmt), interleave_rows(up, fmt)))
        g, u = product(x, interleave_rows(gate, fmt), fmt + "x8"), product(x, interleave_rows(up, fmt), fmt + "x8")
        silu = 0.5 * g * (1 + np.tanh(0.5 * g))  # g / (1 + exp(-g)) without overflow
        np.testing.assert_allclose(got, silu * u, rtol=1e-5, atol=1e-6 * np.abs(g * u).max())


# 8-bit code tiles (batched_weight_dtype="int8"): below their row limit (16), at it, a ragged row group, a half tile
# of 8 columns, K past one depth slice.
INT8_LIMIT = 16
INT8_CASES = [(9, 16, 64), (16, 8, 32), (17, 40, 576), (64, 24, 64), (130, 48, 576), (70, 16, 2048)]


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("m, n, k", INT8_CASES)
def test_8_bit_code_tiles_stay_within_half_a_step_of_each_blocks_scale(fmt, m, n, k):
    """From int8_tile_min_rows rows, interleaved Q4_0 / Q4_1 products take x quantized to int8 per block of 32 on
    AVX2 builds: each within the 8-bit bound of tests/cpu_kernels/test_quantized_matmul.py (one block of x far larger
    than the rest), padding rows not multiplied; below the limit, and for formats without 8-bit tiles here, the
    int16 paths' bits."""
    from tests.cpu_kernels.test_quantized_matmul import int8_error_bound

    raw = weights(fmt, n, k, seed=m * 7 + n)
    x = np.random.default_rng(m + k).standard_normal((m, k)).astype(np.float32)
    x[:, :32] *= 1e4
    want = x.astype(np.float64) @ dequantize_blocks(raw, fmt).astype(np.float64).T
    interleaved = interleave_rows(raw, fmt)
    call = jax.jit(lambda a, b, c: quantized_matmul(a, b, fmt + "x8", live_rows=c, int8_tile_min_rows=INT8_LIMIT,
                                                    **PATHS))
    got = np.asarray(call(np.concatenate([x, x[:2]]), interleaved, np.int32(m)))  # two padding rows
    np.testing.assert_array_less(np.abs(got[:m] - want), int8_error_bound(x, raw, fmt))
    assert not got[m:].any()
    int16 = product(x, interleaved, fmt + "x8")
    if m >= INT8_LIMIT and fmt + "x8" in int8_tile_formats():
        assert np.abs(got[:m] - int16).max() > 0  # the 8-bit path ran
    else:
        np.testing.assert_array_equal(got[:m], int16)


def test_gated_product_with_8_bit_code_tiles():
    """The gated product of interleaved weights from int8_tile_min_rows rows: silu(g) * u of the same 8-bit
    products."""
    fmt, n, k, m = "q4_1", 40, 576, 70
    gate, up = (interleave_rows(weights(fmt, n, k, seed=seed), fmt) for seed in (11, 12))
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    limits = dict(PATHS, int8_tile_min_rows=INT8_LIMIT)
    got = np.asarray(jax.jit(lambda a, b, c: gated_matmul(a, b, c, fmt + "x8", **limits))(x, gate, up))
    g, u = (product(x, w, fmt + "x8", int8_tile_min_rows=INT8_LIMIT) for w in (gate, up))
    silu = 0.5 * g * (1 + np.tanh(0.5 * g))
    np.testing.assert_allclose(got, silu * u, rtol=1e-5, atol=1e-6 * np.abs(g * u).max())


def test_interleaved_blocks_come_in_groups_of_eight_rows():
    raw = interleave_rows(weights("q4_1", 16, 64, seed=3), "q4_1")
    check_blocks(jnp.asarray(raw), 16, 64, "q4_1x8", "a projection")
    with pytest.raises(ValueError, match="groups of 8 rows"):
        check_blocks(jnp.asarray(raw[:12]), 12, 64, "q4_1x8", "a projection")
    with pytest.raises(Exception, match="groups of 8 rows"):
        product(np.ones((1, 64), np.float32), raw[:12], "q4_1x8")


@pytest.mark.parametrize("fmt, rows, k", [("q4_1", 16, 64), ("q4_0", 24, 64), ("q8_0", 8, 96), ("q4_1", 12, 64),
                                          ("q6_k", 16, 256)])
def test_a_projection_takes_the_layout_of_this_machines_kernels(fmt, rows, k):
    """Q8_0 / Q4_0 / Q4_1 projections of whole groups are interleaved where the build prefers it (groups of 8 rows on
    AVX2 without AVX-512, word groups of 16 on AVX-512 with BF16); the layer's products are the same weights' either
    way."""
    raw = weights(fmt, rows, k, seed=rows)
    layer = Linear(k, rows, bias=False, dtype=jnp.float32, rngs=None)
    layer.set_quantized(jnp.asarray(raw), fmt)
    group = 16 if word_groups_preferred() else 8 if interleaved_rows_preferred() else 0
    expected = f"{fmt}x{group}" if group and f"{fmt}x{group}" in INTERLEAVED and rows % group == 0 else fmt
    assert layer.quant == expected
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    w = dequantize_blocks(raw, fmt)
    got = np.asarray(layer(jnp.asarray(x)))
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.astype(np.float64).T), int16_bound(x, w))
    assert native_layout(jnp.asarray(raw), fmt)[1] == layer.quant
