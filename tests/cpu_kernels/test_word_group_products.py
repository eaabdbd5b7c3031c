"""Q8_0 / Q4_0 / Q4_1 weights grouped by code words for 16 rows (models.quantized.interleave_rows(.., 16), the native
kernels' layout on AVX-512 builds with BF16: cpu_kernels/word_group_blocks.h): the layout round trip, and products
with the same bits as the row-major blocks' on both of its paths (the invariant path, its block sums on AMX-INT8
where the CPU has it, the bfloat16 tiles past it), gated too, and the 8-bit tiles asked for; without bfloat16 the invariant path at every row count, against float64; embedding lookups from the
groups."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import amx_block_sum_min_rows, gated_matmul, quantized_matmul, word_groups_preferred
from jvllm.model_loader.gguf_blocks import dequantize_blocks
from models.quantized import check_blocks, dequantize, dequantized_rows, interleave_rows, native_layout
from tests.cpu_kernels.test_interleaved_products import int16_bound, weights

pytestmark = [
    pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                       reason="needs a C++ compiler to build the native kernels"),
]
FORMATS = ["q8_0", "q4_0", "q4_1"]
# The engine's row limits on AVX-512 builds (models.quantized.kernel_row_limits): the invariant path to 16 rows, bf16
# past.
PATHS = dict(bf16_max_rows=8, invariant_max_rows=16)


def needs_word_groups() -> None:
    if not word_groups_preferred():
        pytest.skip("the kernels multiply word groups on AVX-512 builds with BF16 only")


def product(x: np.ndarray, raw: np.ndarray, fmt: str, **paths: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, **{**PATHS, **paths}))(x, raw))


def gated(x: np.ndarray, gate: np.ndarray, up: np.ndarray, fmt: str, **paths: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda a, b, c: gated_matmul(a, b, c, fmt, **{**PATHS, **paths}))(x, gate, up))


@pytest.mark.parametrize("fmt", FORMATS)
def test_word_groups_keep_every_weight(fmt):
    raw = weights(fmt, 32, 96, seed=1)
    grouped = interleave_rows(raw, fmt, 16)
    assert grouped.shape == raw.shape and grouped.dtype == np.uint8
    assert not np.array_equal(grouped, raw)
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(grouped), fmt + "x16", 96)),
                                  dequantize_blocks(raw, fmt))


# (m, n, k): the invariant path (1-16 rows; to 32 where a step asks for it), the bf16 tiles (17+ rows: a lone tile
# of 16 columns where n is an odd multiple of 16, K = 8,192 over several depth slices).
CASES = [(1, 16, 32), (3, 48, 576), (16, 32, 96), (32, 16, 576), (17, 48, 576), (40, 32, 96), (130, 16, 8192)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, n, k", CASES)
def test_products_have_the_row_major_blocks_bits(fmt, m, n, k):
    needs_word_groups()
    paths = dict(invariant_max_rows=32) if m == 32 else {}
    raw = weights(fmt, n, k, seed=m * 100 + n)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = product(x, interleave_rows(raw, fmt, 16), fmt + "x16", **paths)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_array_equal(got, product(x, raw, fmt, **paths))
    gate, up = weights(fmt, n, k, seed=m + 1), weights(fmt, n, k, seed=m + 2)
    np.testing.assert_array_equal(gated(x, interleave_rows(gate, fmt, 16), interleave_rows(up, fmt, 16), fmt + "x16",
                                        **paths),
                                  gated(x, gate, up, fmt, **paths))


@pytest.mark.parametrize("gated_product", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_count_to_16_gives_each_row_its_own_bits(fmt, gated_product):
    """1-16 rows: on AMX-INT8 CPUs from amx_block_sum_min_rows() on the tile unit (x's codes split into bytes: to 7
    rows one tile with a row of ones, then two), else the vector loops; every row the bits it has alone (a decode
    step) and those of the row-major blocks (the vector loops' transposes). Blocks at x's largest codes (+-32767)
    and a block 10^3 larger than the rest."""
    needs_word_groups()
    n, k = 48, 576
    raw, up = weights(fmt, n, k, seed=21), weights(fmt, n, k, seed=22)
    grouped, grouped_up = interleave_rows(raw, fmt, 16), interleave_rows(up, fmt, 16)
    x = np.random.default_rng(23).standard_normal((16, k)).astype(np.float32)
    x[:, :32] *= 1e3
    x[:, 32:64] = np.where(np.arange(32) % 2, 1.0, -1.0)  # every code of the block at +-32767

    def run(rows: np.ndarray, grouped_layout: bool) -> np.ndarray:
        name = fmt + "x16" if grouped_layout else fmt
        if gated_product:
            return gated(rows, grouped if grouped_layout else raw, grouped_up if grouped_layout else up, name)
        return product(rows, grouped if grouped_layout else raw, name)

    alone = np.concatenate([run(x[i:i + 1], True) for i in range(16)])
    for m in range(2, 17):
        together = run(x[:m], True)
        np.testing.assert_array_equal(together, alone[:m], err_msg=f"{m} rows")
        np.testing.assert_array_equal(together, run(x[:m], False), err_msg=f"{m} rows, row-major blocks")


def test_the_tile_unit_gives_the_same_bits_from_two_rows():
    """The test above again with JVLLM_AMX_BLOCK_SUM_ROWS=2 (a subprocess: the kernels read it once), so that the
    tile unit also takes 2 rows, which it leaves to the vector loops by default."""
    if not amx_block_sum_min_rows():
        pytest.skip("the block sums run on the AMX tile unit only on CPUs with AMX-INT8")
    env = {**os.environ, "JVLLM_AMX_BLOCK_SUM_ROWS": "2"}
    test = f"{__file__}::test_every_row_count_to_16_gives_each_row_its_own_bits"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "6 passed" in done.stdout


def test_the_amx_block_sums_are_taken_where_the_cpu_has_amx_int8():
    """amx_block_sum_min_rows(): 3 on AMX-INT8 CPUs with word groups (JVLLM_CPU_AMX not 0; JVLLM_AMX_BLOCK_SUM_ROWS
    sets another count), else 0."""
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    expected = ("amx_int8" in flags and "amx_tile" in flags and word_groups_preferred()
                and os.environ.get("JVLLM_CPU_AMX") != "0")
    assert amx_block_sum_min_rows() == (int(os.environ.get("JVLLM_AMX_BLOCK_SUM_ROWS", "3")) if expected else 0)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("m", [9, 40, 130])
def test_8_bit_tiles_have_the_row_major_blocks_bits(fmt, m):
    """batched_weight_dtype="int8": 8-bit tiles from 9 rows (AVX-512 VNNI), the codes' bytes put back in order."""
    needs_word_groups()
    paths = dict(invariant_max_rows=8, int8_tile_min_rows=9)
    n, k = 48, 576
    raw, up = weights(fmt, n, k, seed=m), weights(fmt, n, k, seed=m + 1)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    np.testing.assert_array_equal(product(x, interleave_rows(raw, fmt, 16), fmt + "x16", **paths),
                                  product(x, raw, fmt, **paths))
    np.testing.assert_array_equal(gated(x, interleave_rows(raw, fmt, 16), interleave_rows(up, fmt, 16), fmt + "x16",
                                        **paths),
                                  gated(x, raw, up, fmt, **paths))


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_bfloat16_every_row_count_takes_the_invariant_path(fmt):
    """bf16_products(False) (batched_weight_dtype=None): int16 activations at every row count, each row's bits its
    own."""
    needs_word_groups()
    n, k = 32, 576
    raw = weights(fmt, n, k, seed=9)
    grouped = interleave_rows(raw, fmt, 16)
    x = np.random.default_rng(9).standard_normal((40, k)).astype(np.float32)
    got = product(x, grouped, fmt + "x16", bf16_max_rows=0)
    w = dequantize_blocks(raw, fmt)
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.astype(np.float64).T), int16_bound(x, w))
    np.testing.assert_array_equal(got[:1], product(x[:1], grouped, fmt + "x16", bf16_max_rows=0))


def test_word_groups_come_in_groups_of_sixteen_rows():
    raw = interleave_rows(weights("q4_1", 32, 64, seed=3), "q4_1", 16)
    check_blocks(jnp.asarray(raw), 32, 64, "q4_1x16", "a projection")
    with pytest.raises(ValueError, match="groups of 16 rows"):
        check_blocks(jnp.asarray(raw[:24]), 24, 64, "q4_1x16", "a projection")
    if word_groups_preferred():
        with pytest.raises(Exception, match="groups of 16 rows"):
            product(np.ones((1, 64), np.float32), raw[:24], "q4_1x16")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [8, 16])
def test_a_lookup_gathers_each_rows_blocks_from_its_group(fmt, rows):
    """An embedding table in a group layout (a tied LM head multiplies it) gives the row-major table's rows."""
    raw = weights(fmt, 64, 96, seed=11)
    ids = jnp.asarray([0, 5, 17, 63, 31, 16, 5], jnp.int32)
    got = dequantized_rows(jnp.asarray(interleave_rows(raw, fmt, rows)), ids, f"{fmt}x{rows}", 96)
    np.testing.assert_array_equal(np.asarray(got), dequantize_blocks(raw, fmt)[np.asarray(ids)])


def test_an_embedding_table_takes_word_groups_only():
    """Tables (lookups, and the tied head's products) take the word groups where the build prefers them, never the
    groups of 8 rows."""
    raw = jnp.asarray(weights("q8_0", 32, 64, seed=12))
    fmt = native_layout(raw, "q8_0", table=True)[1]
    assert fmt == ("q8_0x16" if word_groups_preferred() else "q8_0")
