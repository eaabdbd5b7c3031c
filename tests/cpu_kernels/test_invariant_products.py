"""The invariant path of the native quantized products (cpu_kernels/invariant_products.h): for every block format,
each row of x gets the same bits alone as among up to 32 rows, plain and gated, and stays within the int16
activations' precision of gguf's reference dequantizer followed by a float64 product. The int16 row path (the
invariant rows of AVX2 builds) gives each row its own bits too, up to its row limit."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import gated_matmul, invariant_max_rows, quantized_matmul, row_path_limits
from jvllm.model_loader.gguf_blocks import dequantize_blocks
from models.quantized import FORMATS as BLOCK_FORMATS
from models.quantized import quantize_reference, random_blocks

pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")

FORMATS = sorted(BLOCK_FORMATS)
# (N, K): a ragged group of output columns, a lone block of depth (a lone 256-weight block for the K-quants), several
# groups with a ragged last one.
SHAPES = [(7, 64), (33, 576), (130, 1536)]
K_SHAPES = [(7, 256), (33, 768), (130, 1536)]


def shapes(fmt: str) -> list[tuple[int, int]]:
    return K_SHAPES if BLOCK_FORMATS[fmt].block_size == 256 else SHAPES


def blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks of random weights whose rows' scales differ by up to 10^4 (gguf's quantizer where it has the format;
    random codes with set scales for the K-quants)."""
    rng = np.random.default_rng(seed)
    scales = np.float32(10.0) ** rng.integers(-3, 2, size=(n, 1)).astype(np.float32)
    if BLOCK_FORMATS[fmt].block_size == 256:
        return np.concatenate([random_blocks(1, k, fmt, rng, scale=float(s)) for s in scales[:, 0]])
    return quantize_reference(rng.standard_normal((n, k)).astype(np.float32) * scales, fmt)


def test_the_build_says_how_many_rows_the_path_takes():
    """AVX-512 builds take up to 32 rows on it (a verification step of 31 drafts); others none."""
    assert invariant_max_rows() in (0, 32)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("fmt, n, k", [(fmt, n, k) for fmt in FORMATS for n, k in shapes(fmt)])
def test_a_row_gives_the_same_bits_alone_as_among_up_to_32_rows(fmt, n, k, gated):
    """A one-token decode step and the same token among draft tokens in a verification step compute the same bits,
    at every row count the path takes; padding rows stay zero."""
    if not invariant_max_rows():
        pytest.skip("this build has no invariant path (AVX-512 builds only)")
    raw, up = blocks(fmt, n, k, seed=n), blocks(fmt, n, k, seed=n + 1)
    x = np.random.default_rng(k).standard_normal((32, k)).astype(np.float32)
    x[:, :32] *= 1e3  # one block far larger than the rest: each block has its own scale
    if gated:
        product = jax.jit(lambda a, c: gated_matmul(a, raw, up, fmt, live_rows=c, invariant_max_rows=32))
    else:
        product = jax.jit(lambda a, c: quantized_matmul(a, raw, fmt, live_rows=c, invariant_max_rows=32))
    alone = np.stack([np.asarray(product(x[i:i + 1], np.int32(1)))[0] for i in range(32)])
    for rows in (2, 3, 7, 8, 9, 16, 31, 32):
        together = np.asarray(product(x, np.int32(rows)))
        np.testing.assert_array_equal(together[:rows], alone[:rows], err_msg=f"{rows} rows")
        assert not together[rows:].any()


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("fmt, n, k", [(fmt, n, k) for fmt in FORMATS for n, k in shapes(fmt)])
def test_the_int16_row_path_gives_each_row_its_own_bits(fmt, n, k, gated):
    """Up to its row limit (8 on AVX2 builds, where it serves batch_invariant's steps; 4 on AVX-512 builds) the int16
    row path multiplies each row of x alone: one row or a group of up to 8 (scaled together, Matmul::IntRows), the
    same bits; padding rows stay zero."""
    limit = row_path_limits()[0]
    if not limit:
        pytest.skip("this build has no int16 row path (AVX2 or AVX-512 builds only)")
    raw, up = blocks(fmt, n, k, seed=n), blocks(fmt, n, k, seed=n + 1)
    x = np.random.default_rng(k).standard_normal((limit, k)).astype(np.float32)
    x[:, :32] *= 1e3
    paths = dict(int16_max_rows=limit, invariant_max_rows=0)
    if gated:
        product = jax.jit(lambda a, c: gated_matmul(a, raw, up, fmt, live_rows=c, **paths))
    else:
        product = jax.jit(lambda a, c: quantized_matmul(a, raw, fmt, live_rows=c, **paths))
    alone = np.stack([np.asarray(product(x[i:i + 1], np.int32(1)))[0] for i in range(limit)])
    for rows in range(2, limit + 1):
        together = np.asarray(product(x, np.int32(rows)))
        np.testing.assert_array_equal(together[:rows], alone[:rows], err_msg=f"{rows} rows")
        assert not together[rows:].any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 32])
def test_the_path_stays_within_int16_precision(fmt, m):
    """x in int16 per block of 32 (max |x| / 32767 a step): each output within half a step of each block's scale
    times the block's sum |w| (max |x| / 16383 for Q6_K, whose codes carry its group scales), plus float32 sums; the
    gated product within silu's slope of that."""
    n, k = shapes(fmt)[1]
    raw, up = blocks(fmt, n, k, seed=3), blocks(fmt, n, k, seed=4)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    x[:, 32:64] *= 1e4
    w, u = (dequantize_blocks(r, fmt).astype(np.float64) for r in (raw, up))
    block_max = np.abs(x).reshape(m, k // 32, 32).max(-1)  # [m, blocks]

    def bound(weights: np.ndarray) -> np.ndarray:
        steps = block_max @ np.abs(weights).reshape(n, k // 32, 32).sum(-1).T / (16383 if fmt == "q6_k" else 32767)
        return steps + 1e-6 * np.abs(x) @ np.abs(weights).T + 1e-30

    got = np.asarray(jax.jit(lambda a: quantized_matmul(a, raw, fmt, invariant_max_rows=32))(x))
    want = x.astype(np.float64) @ w.T
    np.testing.assert_array_less(np.abs(got - want), bound(w))
    gate_want, up_want = want, x.astype(np.float64) @ u.T
    silu = gate_want / (1.0 + np.exp(-gate_want))
    got_gated = np.asarray(jax.jit(lambda a: gated_matmul(a, raw, up, fmt, invariant_max_rows=32))(x))
    gated_bound = 1.1 * bound(w) * np.abs(up_want) + np.abs(silu) * bound(u) + 1e-5 * np.abs(silu * up_want)
    np.testing.assert_array_less(np.abs(got_gated - silu * up_want), gated_bound)


def test_invariant_steps_reach_16_rows_where_every_weight_is_in_gguf_blocks():
    """The engine's invariant step rows (models.quantized.invariant_step_rows): 16 for a model of GGUF blocks where the
    build has the path, the bfloat16 rows' 8 as soon as a weight is in a per-channel format (XLA's dots)."""
    from cpu_kernels.quantized_matmul import bf16_max_rows
    from models.quantized import INVARIANT_PATH_ROWS, invariant_step_rows

    fallback = bf16_max_rows() or 8
    assert invariant_step_rows({"q4_1", "q8_0"}) == (INVARIANT_PATH_ROWS if invariant_max_rows() else fallback)
    assert invariant_step_rows({"q4_k", "q6_k"}) == (INVARIANT_PATH_ROWS if invariant_max_rows() else fallback)
    assert invariant_step_rows({"q4_0", "int8"}) == fallback  # a per-channel format: XLA's dots
    assert invariant_step_rows(set()) == fallback  # float weights
