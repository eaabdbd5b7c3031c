"""The many-row bfloat16 products on Intel's AMX tile unit (cpu_kernels/amx_tiles.h, inside bf16_tiles.h): on CPUs
with AMX-BF16 they run there, within float32 summation of float64 products, and agree with the same products on
AVX-512 BF16 (JVLLM_CPU_AMX=0, in a subprocess). Row counts cover 32- and 16-row tile groups and a last group of
fewer than 16 rows (a zero-padded tile), and products of 512+ rows, whose rows the threads share; bf16 weights both
ways round, GGUF blocks (row-major and grouped by code words), and an MLP's gate and up weights summed into
silu(gate) * up."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

# (kind, rows, K, N): 300 rows = 4 blocks of 128 (4 x 32 row tiles) less 84, then 32 + a group of 12; 49 rows
# = 32 + 16 + 1; 17 columns: a partial weight tile; K = 2,048: depth slices of 512 pairs added into y. From 512
# rows the threads share the rows (530: shares of whole 32-row blocks, the last ending in 16 + a group of 2); "wg":
# the blocks grouped by code words where this build multiplies them so (models.quantized.native_layout).
CASES = [("bf16_in_out", 300, 576, 96), ("bf16_in_out", 49, 2048, 17), ("bf16_out_in", 64, 1536, 40),
         ("q8_0_gated", 48, 576, 40), ("q8_0_gated", 130, 2048, 17), ("q6_k_gated", 64, 512, 24),
         ("bf16_out_in", 530, 576, 72), ("q4_1_wg", 530, 1536, 48), ("q8_0_wg_gated", 600, 576, 40),
         ("q6_k", 530, 512, 40), ("q6_k_gated", 513, 512, 24)]
REPO = pathlib.Path(__file__).resolve().parents[2]


def _case(kind: str, rows: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(got, want, bound): the kernel's product, the float64 one of x and the weights rounded to bfloat16 (as the
    kernel takes them), and a bound on float32 summation's error (gated: through silu and the up product)."""
    import jax
    import jax.numpy as jnp

    from cpu_kernels.bf16_rows import bf16_tiles_product
    from cpu_kernels.quantized_matmul import bf16_max_rows, gated_matmul, quantized_matmul
    from jvllm.model_loader.gguf_blocks import dequantize_blocks
    from models.quantized import native_layout, random_blocks

    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x16 = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    sum_error = 4 * k * 2.0 ** -24
    if kind.startswith("bf16"):
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)  # [K, N]
        out_in = kind == "bf16_out_in"
        got = jax.jit(lambda a, b: bf16_tiles_product(a, b, out_in))(x, w.T if out_in else w)
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        return np.asarray(got), x16 @ w64, sum_error * (np.abs(x16) @ np.abs(w64)) + 1e-30
    fmt = kind.removesuffix("_gated").removesuffix("_wg")
    gate, up = random_blocks(n, k, fmt, rng, scale=0.05), random_blocks(n, k, fmt, rng, scale=0.05)
    g_w, u_w = (np.asarray(jnp.asarray(dequantize_blocks(raw, fmt), jnp.float32).astype(jnp.bfloat16), np.float64)
                for raw in (gate, up))  # the tiles hold the weights rounded to bfloat16
    layout = (lambda raw: native_layout(jnp.asarray(raw), fmt)) if "_wg" in kind else (lambda raw: (raw, fmt))
    (gate, native_fmt), (up, _) = layout(gate), layout(up)
    if not kind.endswith("_gated"):
        got = jax.jit(lambda a, b: quantized_matmul(a, b, native_fmt, bf16_max_rows=bf16_max_rows()))(x, gate)
        return np.asarray(got), x16 @ g_w.T, sum_error * (np.abs(x16) @ np.abs(g_w).T) + 1e-30
    got = jax.jit(lambda a, b, c: gated_matmul(a, b, c, native_fmt, bf16_max_rows=bf16_max_rows()))(x, gate, up)
    g, u = x16 @ g_w.T, x16 @ u_w.T
    g_err, u_err = (sum_error * (np.abs(x16) @ np.abs(w).T) for w in (g_w, u_w))
    silu = g / (1.0 + np.exp(-g))
    return np.asarray(got), silu * u, 1.1 * g_err * (np.abs(u) + u_err) + np.abs(silu) * u_err + 1e-30


def _amx_here() -> bool:
    from cpu_kernels.bf16_rows import amx_products
    return amx_products()


pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")


def test_the_tiles_run_on_amx_exactly_where_the_cpu_has_it():
    """AMX where /proc/cpuinfo lists amx_bf16 (and AVX-512 BF16, which the tiles' other paths need), unless
    JVLLM_CPU_AMX=0; never elsewhere."""
    from cpu_kernels.build import _cpu_flags

    flags = _cpu_flags().split()
    expected = {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(flags) and os.environ.get("JVLLM_CPU_AMX") != "0"
    assert _amx_here() == expected


@pytest.mark.parametrize("kind, rows, k, n", CASES)
def test_tiled_products_are_float32_sums_of_the_bf16_products(kind, rows, k, n):
    from cpu_kernels.bf16_rows import bf16_tiles_available

    if not bf16_tiles_available():
        pytest.skip("no AVX-512 BF16: these products take other paths (tests/cpu_kernels/test_gated_matmul.py)")
    got, want, bound = _case(kind, rows, k, n)
    assert got.shape == (rows, n)
    assert np.all(np.abs(got - want) <= bound)


def test_amx_gives_the_vector_products_within_float32_summation(tmp_path):
    """The same cases with JVLLM_CPU_AMX=0 in a subprocess (the AVX-512 BF16 tiles): each output within the two
    paths' summation bounds of the other's (they add the same bf16 products in different orders)."""
    if not _amx_here():
        pytest.skip("no AMX here: the vector products are the only ones (the test above)")
    out = tmp_path / "vector.npz"
    env = {**os.environ, "JVLLM_CPU_AMX": "0", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, __file__, json.dumps(CASES), str(out)], env=env, check=True, cwd=REPO,
                   timeout=600)
    vector = np.load(out)
    for i, case in enumerate(CASES):
        got, _, bound = _case(*case)
        assert np.all(np.abs(got - vector[f"case{i}"]) <= 2 * bound), case


if __name__ == "__main__":  # the subprocess above: the cases' products to an .npz
    cases, path = json.loads(sys.argv[1]), sys.argv[2]
    np.savez(path, **{f"case{i}": _case(*case)[0] for i, case in enumerate(cases)})
