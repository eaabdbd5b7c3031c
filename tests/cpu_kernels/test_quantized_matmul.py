"""The native quantized matmul (cpu_kernels/quantized_matmul.cc) and the jnp dequantization (models.quantized)
against gguf's reference dequantizer followed by a float64 product, for every block format, row count (the
in-register path for one row, the tiled path beyond) and ragged output widths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import bf16_max_rows, int8_tile_formats, quantized_matmul, row_path_limits
from jvllm.model_loader.gguf_blocks import dequantize_blocks
from models.quantized import FORMATS, dequantize, dequantized_rows, quantize_reference, quantized_dot
from models.quantized import _scale_min_k as scale_min_k
from models.quantized import random_blocks as random_codes

pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")


K_QUANTS = [name for name, spec in FORMATS.items() if spec.block_size == 256]
# (N, K) per test: the 32-weight formats, and the same widths in 256-weight blocks for the K-quants.
SHAPES = [(1, 32), (7, 64), (33, 576), (130, 96)]


def shapes(fmt: str) -> list[tuple[int, int]]:
    return [(n, k * 8) for n, k in SHAPES] if fmt in K_QUANTS else SHAPES


def cases(rows: list[int], k_quant_rows: list[int]) -> list[tuple[str, int, int, int]]:
    """Every format x rows x shape; the K-quants (the same loops, other decoders) on fewer row counts."""
    return [(fmt, m, n, k) for fmt in FORMATS for m in (k_quant_rows if fmt in K_QUANTS else rows)
            for n, k in shapes(fmt)]


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF blocks of random weights, with some rows scaled far apart (the scales differ by 10^4): quantized by
    gguf's reference where it quantizes the format, random codes with set scales for the K-quants."""
    rng = np.random.default_rng(seed)
    row_scales = np.float32(10.0) ** rng.integers(-3, 2, size=(n, 1)).astype(np.float32)
    if fmt in K_QUANTS:
        return np.concatenate([random_codes(1, k, fmt, rng, scale=float(s)) for s in row_scales[:, 0]])
    weights = rng.standard_normal((n, k)).astype(np.float32) * row_scales
    return quantize_reference(weights, fmt)


# Prefill-sized products (the blocked path from 128 rows): ragged row groups and blocks of x, depth slices, tiles
# split across chunks (K = 8192: two tiles a chunk), in both block sizes.
PREFILL_CASES = [("q4_1", 130, 33, 576), ("q8_0", 263, 130, 96), ("q6_k", 134, 7, 768), ("q4_1", 129, 50, 8192),
                 ("q4_k", 128, 40, 8192)]


@pytest.mark.parametrize("fmt, m, n, k", cases([1, 2, 3, 4, 5, 17, 64], [1, 5, 17]) + PREFILL_CASES)
def test_kernel_matches_dequantize_then_float64_matmul(fmt, m, n, k):
    raw = random_blocks(fmt, n, k, seed=m * 1000 + n)
    x = np.random.default_rng(n).standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_blocks(raw, fmt).astype(np.float64).T
    got = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt))(x, raw))
    assert got.shape == (m, n) and got.dtype == np.float32
    scale = np.abs(x).astype(np.float64) @ np.abs(dequantize_blocks(raw, fmt)).astype(np.float64).T
    np.testing.assert_array_less(np.abs(got - want), 1e-6 * scale + 1e-30)  # float32 sums: ~K ulps of |x| |w|


@pytest.mark.parametrize("m, live", [(64, 37), (64, 1), (16, 5), (256, 200), (8, 0), (4, 4), (4, 9)])
def test_only_the_live_rows_are_multiplied_and_the_padding_is_zero(m, live):
    """A step pads its tokens to the shape's rows; `live_rows` (traced) limits the product to the real ones, through
    the path their count picks (the int16 rows, float tiles or int16 tiles), and writes 0 to the rest."""
    fmt, n, k = "q4_1", 130, 576
    raw = random_blocks(fmt, n, k, seed=live)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    options = dict(int16_max_rows=8, int16_tile_min_rows=64)
    product = jax.jit(lambda a, b, c: quantized_matmul(a, b, fmt, **options, live_rows=c))
    got = np.asarray(product(x, raw, np.int32(live)))
    real = min(live, m)
    want = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, **options))(x[:real], raw)) if real else None
    if real:
        np.testing.assert_array_equal(got[:real], want)  # the same path and sums as a product of just those rows
    assert not got[real:].any()


# (path, fmt, m, n, k): "rows" multiplies each row of x with the blocks unpacked in registers (up to 8 rows),
# "tiles" with 16-bit code tiles (prefill sizes; here from one row, to cover ragged row groups too).
INT16_CASES = ([("rows", *case) for case in cases([1, 2, 3, 4, 5, 8], [1, 3, 8])]
               + [("tiles", *case) for case in cases([1, 7, 23, 64], [5, 17]) + PREFILL_CASES])


@pytest.mark.parametrize("path, fmt, m, n, k", INT16_CASES)
def test_int16_activation_paths_stay_within_their_precision(path, fmt, m, n, k):
    """Activations quantized to int16 per block of 32 (one scale each): each product is within a few 1e-5 of
    max|x| . sum|w| per block, far below float32-vs-bfloat16 differences. The tiles sum a whole block in 32 bits, so
    for Q6_K (group scales folded into codes up to 4,096) x keeps 14 bits there."""
    raw = random_blocks(fmt, n, k, seed=m * 77 + n)
    x = np.random.default_rng(k).standard_normal((m, k)).astype(np.float32)
    x[:, :32] *= 1e4  # one block far larger than the rest: each block has its own scale
    w = dequantize_blocks(raw, fmt).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    options = {"int16_max_rows": 8} if path == "rows" else {"int16_tile_min_rows": 1}
    got = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, **options))(x, raw))
    limit = 16383 if path == "tiles" and fmt == "q6_k" else 32767
    block_max = np.abs(x).reshape(m, k // 32, 32).max(-1)  # [m, blocks]
    bound = block_max @ np.abs(w).reshape(n, k // 32, 32).sum(-1).T / limit  # half a step per element, summed
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-6 * np.abs(x) @ np.abs(w).T + 1e-30)


@pytest.mark.parametrize("fmt, m, n, k", cases([1, 2, 3, 5, 8, 9, 13, 40, 130], [1, 2, 8, 9, 40]))
def test_bf16_rows_stay_within_bfloat16_precision(fmt, m, n, k):
    """Rows in bfloat16 from one (builds with AVX-512 BF16: the row path to 8 rows, tiles beyond, over partial tile pairs,
    several depth slices and row blocks; elsewhere the int16 or float paths, within their tighter bounds): x and the
    dequantized weights rounded to 8 bits of mantissa, products summed in float32, so each output is within ~2^-8 of
    sum |x| |w| (two roundings of 2^-9 each)."""
    raw = random_blocks(fmt, n, k, seed=m * 31 + n)
    x = np.random.default_rng(k + m).standard_normal((m, k)).astype(np.float32)
    w = dequantize_blocks(raw, fmt).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    product = jax.jit(lambda a, b, c: quantized_matmul(a, b, fmt, live_rows=c, bf16_max_rows=8, bf16_min_rows=1))
    got = np.asarray(product(np.concatenate([x, x[:1]]), raw, np.int32(m)))  # one padding row, not multiplied
    np.testing.assert_array_less(np.abs(got[:m] - want), 2.0 ** -8 * np.abs(x) @ np.abs(w).T + 1e-30)
    assert not got[m:].any()
    if bf16_max_rows():  # the bfloat16 path ran: not the float32 product
        exact = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt))(x, raw))
        assert np.abs(got[:m] - exact).max() > 0


def int8_error_bound(x: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
    """[m, n] bound on the 8-bit tiles' error: x rounded to half a step of its block scale (max |x| / 127) against
    each block's d q (the weights less the block constant, which meets x's exact sum), plus float32 sums."""
    n, k = raw.shape[0], x.shape[1]
    blocks = raw.reshape(n, k // FORMATS[fmt].block_size, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    if fmt in K_QUANTS:  # each sub-block's constant -dmin m
        c = (-dmin[..., None] * np.asarray(scale_min_k(blocks[..., 4:16])[1], np.float64)).reshape(n, k // 32)
    else:
        c = dmin if fmt == "q4_1" else -8.0 * d
    w = dequantize_blocks(raw, fmt).astype(np.float64)
    dq = np.abs(w.reshape(n, k // 32, 32) - c[..., None]).sum(-1)  # [n, blocks]
    half_step = np.abs(x).astype(np.float64).reshape(x.shape[0], k // 32, 32).max(-1) / 254.0  # [m, blocks]
    return half_step @ dq.T * (1 + 1e-5) + 1e-6 * np.abs(x) @ np.abs(w).T + 1e-30


# 8-bit tiles: from one row (to cover ragged row groups of 6), ragged tiles and pairs, K past one depth slice.
INT8_CASES = [(fmt, m, n, k) for fmt in ("q4_0", "q4_1") for m in (1, 6, 11, 130) for n, k in ((17, 64), (48, 576))]
INT8_CASES += [("q4_1", 64, 40, 8192), ("q4_0", 129, 33, 1056)]
INT8_CASES += [(fmt, m, n, k) for fmt in ("q4_k", "q5_k") for m, n, k in ((1, 17, 256), (13, 48, 768), (70, 33, 8192))]


@pytest.mark.parametrize("fmt, m, n, k", INT8_CASES)
def test_int8_tiles_stay_within_half_a_step_of_each_blocks_scale(fmt, m, n, k):
    """Activations quantized to int8 per block of 32 (builds with AVX-512 VNNI; elsewhere these row-major blocks
    keep the bf16 or int16 paths, within tighter bounds): each product within max |x| / 254 of the block times its
    sum |d q|, one block of x far larger than the rest (each block has its own scale); padding rows are not
    multiplied."""
    raw = random_blocks(fmt, n, k, seed=m * 13 + n)
    x = np.random.default_rng(k + m).standard_normal((m, k)).astype(np.float32)
    x[:, :32] *= 1e4
    want = x.astype(np.float64) @ dequantize_blocks(raw, fmt).astype(np.float64).T
    product = jax.jit(lambda a, b, c: quantized_matmul(a, b, fmt, live_rows=c, bf16_max_rows=bf16_max_rows(),
                                                       int8_tile_min_rows=1))
    got = np.asarray(product(np.concatenate([x, x[:2]]), raw, np.int32(m)))  # two padding rows
    np.testing.assert_array_less(np.abs(got[:m] - want), int8_error_bound(x, raw, fmt))
    assert not got[m:].any()
    if fmt in int8_tile_formats():  # the 8-bit path ran: not the bfloat16 or float32 products
        other = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, bf16_max_rows=bf16_max_rows()))(x, raw))
        assert np.abs(got[:m] - other).max() > 0


def test_int8_tiles_are_taken_from_their_row_limit_only():
    """Below int8_tile_min_rows a product keeps its other path, bit for bit; Q6_K and Q8_0 blocks never take
    8-bit tiles."""
    n = 40
    for fmt, rows, k in (("q4_1", 9, 576), ("q5_k", 9, 512), ("q6_k", 70, 512), ("q8_0", 70, 576)):
        raw = random_blocks(fmt, n, k, seed=rows)
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
        plain = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, bf16_max_rows=8))(x, raw))
        limited = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, bf16_max_rows=8,
                                                                   int8_tile_min_rows=64))(x, raw))
        np.testing.assert_array_equal(limited, plain)


def test_an_output_too_large_for_the_caches_is_streamed_out_whole():
    """A product whose output passes 16 MB (a decode step's logits) in one depth slice is written with streaming
    stores on the bf16 path: every row and column, the last partial tile's included, as the bounded product."""
    m, k, n = 96, 64, 44_001  # [96, 44,001] float32: 16.9 MB
    raw = random_blocks("q8_0", n, k, seed=5)
    x = np.random.default_rng(6).standard_normal((m, k)).astype(np.float32)
    w = dequantize_blocks(raw, "q8_0").astype(np.float64)
    got = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, "q8_0", bf16_max_rows=8))(x, raw))
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.T), 2.0 ** -8 * np.abs(x) @ np.abs(w).T + 1e-30)


def test_int16_tiles_keep_int32_sums_of_extreme_blocks():
    """Q6_K codes at their extreme (group scale -128 times q - 32 = -32: 4,096) against x at its largest in every
    element: a block's 32 products stay within int32 in the tiles, so the product is the float one."""
    k, n, m = 256, 16, 64
    raw = np.zeros((n, 210), np.uint8)  # ql, qh = 0: q = 0, q - 32 = -32
    raw[:, 192:208] = np.uint8(128)  # int8 group scales -128
    raw[:, 208:210] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    x = np.full((m, k), 3.0, np.float32)
    w = dequantize_blocks(raw, "q6_k").astype(np.float64)
    want = x.astype(np.float64) @ w.T
    got = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, "q6_k", int16_tile_min_rows=1))(x, raw))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_jnp_dequantize_is_the_reference_bit_for_bit(fmt):
    k = FORMATS[fmt].block_size * 5
    raw = random_blocks(fmt, 40, k, seed=7)
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(raw), fmt, k)), dequantize_blocks(raw, fmt))
    ids = jnp.asarray([3, 0, 39, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(dequantized_rows(jnp.asarray(raw), ids, fmt, k)),
                                  dequantize_blocks(raw, fmt)[[3, 0, 39, 3]])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_xla_fallback_gives_the_kernels_products(fmt, monkeypatch):
    """Where the kernel does not run (another backend), quantized_dot dequantizes in the step instead. 16 rows take
    the kernel's float tiles on AVX2 builds (the float product up to summation order), its int16 code tiles on
    AVX-512 ones (x rounded to 15 bits a block: within ~3e-5 of the largest product) and its bf16 tiles with AVX-512
    BF16 (within 2^-8 of sum |x| |w|)."""
    from models import quantized

    k = FORMATS[fmt].block_size * 3
    raw = jnp.asarray(random_blocks(fmt, 48, k, seed=3))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, k)).astype(np.float32))
    native = np.asarray(jax.jit(lambda a, b: quantized_dot(a, b, fmt))(x, raw))
    monkeypatch.setattr(quantized, "native_kernel_available", lambda: False)
    fallback = np.asarray(jax.jit(lambda a, b: quantized_dot(a, b, fmt))(x, raw))
    if bf16_max_rows():
        w = np.asarray(dequantize_blocks(np.asarray(raw), fmt), np.float64)
        bound = 2.0 ** -8 * np.abs(np.asarray(x, np.float64)) @ np.abs(w).T
        np.testing.assert_array_less(np.abs(native - fallback), bound + 1e-30)
        return
    max_rows, tile_min_rows = row_path_limits()
    tolerance = 1e-5 if max_rows < 16 < tile_min_rows else 1e-4
    np.testing.assert_allclose(native, fallback, rtol=tolerance, atol=tolerance * np.abs(fallback).max())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="20 bytes a row in q4_1"):
        quantized_matmul(jnp.zeros((1, 32)), jnp.zeros((4, 34), jnp.uint8), "q4_1")
    with pytest.raises(ValueError, match="whole blocks of 256 weights"):
        quantized_matmul(jnp.zeros((1, 288)), jnp.zeros((4, 144), jnp.uint8), "q4_k")
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        FORMATS["q8_0"].row_bytes(48)


@pytest.mark.parametrize("fmt, rms_error", [("q4_k", 0.1), ("q5_k", 0.05), ("q6_k", 0.03)])
def test_k_quantizer_writes_blocks_the_reference_reads_back(fmt, rms_error):
    """models.quantize_k's blocks, read by gguf's dequantizer, give back the weights within the format's precision
    (relative RMS error), rows of very different scales included."""
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((24, 768)).astype(np.float32) * np.float32(10.0) ** rng.integers(-2, 2, (24, 1))
    raw = quantize_reference(weights, fmt)
    assert raw.shape == (24, 3 * FORMATS[fmt].block_bytes) and raw.dtype == np.uint8
    back = dequantize_blocks(raw, fmt)
    relative = np.sqrt(((back - weights) ** 2).mean(-1)) / weights.std(-1)
    assert relative.max() < rms_error


def test_the_build_picks_row_path_limits_that_leave_no_row_count_out():
    """The engine's limits come from the kernel build: the per-row path up to the first, code tiles from the second;
    any rows between go through the float tiles, so the two are ordered."""
    max_rows, tile_min_rows = row_path_limits()
    assert 0 < max_rows < tile_min_rows


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0", "q4_k", "q6_k"])
def test_a_row_gives_the_same_bits_alone_as_among_up_to_8_rows(fmt):
    """With the row paths of an engine that speculates (bfloat16 from one row on AVX-512 BF16 builds), a row's product
    does not depend on how many rows come with it: a one-token decode step and the same token among draft tokens in
    a verification step compute the same bits."""
    n, k = (33, 576) if fmt not in K_QUANTS else (33, 768)
    raw = random_blocks(fmt, n, k, seed=5)
    x = np.random.default_rng(6).standard_normal((8, k)).astype(np.float32)
    options = dict(zip(("int16_max_rows", "int16_tile_min_rows"), row_path_limits()), bf16_max_rows=bf16_max_rows(),
                   bf16_min_rows=1)
    product = jax.jit(lambda a, b, c: quantized_matmul(a, b, fmt, live_rows=c, **options))
    alone = [np.asarray(product(x[i:i + 1], raw, np.int32(1)))[0] for i in range(8)]
    for rows in range(2, 9):
        together = np.asarray(product(x, raw, np.int32(rows)))
        for i in range(rows):
            np.testing.assert_array_equal(together[i], alone[i], err_msg=f"row {i} of {rows}")
