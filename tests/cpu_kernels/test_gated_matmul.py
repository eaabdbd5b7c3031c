"""The gated product of an MLP's gate and up GGUF weights (cpu_kernels/quantized_matmul.cc, jvllm_gated_matmul):
silu(x G^T) * (x U^T) against the same from gguf's reference dequantizer and float64 products, on every row path
(one pass over paired gate/up bf16 tiles past 8 rows on AVX-512 BF16 builds, two products and a combine
elsewhere), with ragged tiles, a depth past one slice and padding rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import bf16_max_rows, gated_matmul, quantized_matmul, row_path_limits
from jvllm.model_loader.gguf_blocks import dequantize_blocks
from models.quantized import random_blocks

pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def gated_case(fmt: str, m: int, n: int, k: int, seed: int):
    """x [m, k] and gate/up blocks [n, row bytes] -> (x, gate, up, want, bound): the float64 activations and a bound
    on a kernel's error with bfloat16 products (each within 2^-8 of sum |x| |w|, silu's slope at most 1.1)."""
    rng = np.random.default_rng(seed)
    gate, up = random_blocks(n, k, fmt, rng, scale=0.05), random_blocks(n, k, fmt, rng, scale=0.05)
    x = rng.standard_normal((m, k)).astype(np.float32)
    g_w, u_w = (dequantize_blocks(raw, fmt).astype(np.float64) for raw in (gate, up))
    g, u = x.astype(np.float64) @ g_w.T, x.astype(np.float64) @ u_w.T
    g_err, u_err = (2.0 ** -8 * np.abs(x).astype(np.float64) @ np.abs(w).T for w in (g_w, u_w))
    bound = 1.1 * g_err * (np.abs(u) + u_err) + np.abs(g) * u_err + 1e-30
    return x, gate, up, silu(g) * u, bound


# (fmt, m, n, k): one row (int16 or float), the bf16 rows (2-8), the paired tiles (9+: a partial row group, a
# partial tile of 17 columns, K = 2,048 summed as one slice of 1,024 pairs), K-quants on both sides of 8 rows.
CASES = [("q4_1", m, n, k) for m in (1, 3, 8, 9, 40, 130) for n, k in ((17, 64), (48, 576))]
CASES += [("q8_0", 13, 33, 2048), ("q4_0", 24, 16, 96), ("q4_k", 5, 20, 512), ("q6_k", 30, 40, 512),
          ("q5_k", 12, 9, 256)]


@pytest.mark.parametrize("fmt, m, n, k", CASES)
def test_gated_product_is_silu_of_gate_times_up(fmt, m, n, k):
    x, gate, up, want, bound = gated_case(fmt, m, n, k, seed=m * 100 + n)
    call = jax.jit(lambda a, b, c, live: gated_matmul(a, b, c, fmt, *row_path_limits(), live_rows=live,
                                                      bf16_max_rows=bf16_max_rows()))
    padded = np.concatenate([x, np.ones((2, k), np.float32)])  # two padding rows, not multiplied
    got = np.asarray(call(padded, gate, up, np.int32(m)))
    assert got.shape == (m + 2, n) and got.dtype == np.float32
    np.testing.assert_array_less(np.abs(got[:m] - want), bound)
    assert not got[m:].any()


@pytest.mark.parametrize("m", [3, 40])
def test_gated_product_keeps_the_products_of_the_plain_kernel(m):
    """The same rows path and sums as two quantized_matmul calls, up to float32 rounding of the combine: gate and
    up are not swapped, columns not shifted (silu(g) * u is not symmetric in g and u)."""
    fmt, n, k = "q4_1", 50, 576
    x, gate, up, _, _ = gated_case(fmt, m, n, k, seed=7)
    limits = dict(bf16_max_rows=bf16_max_rows())
    g, u = (np.asarray(quantized_matmul(jnp.asarray(x), jnp.asarray(w), fmt, **limits), np.float64) for w in (gate, up))
    got = np.asarray(gated_matmul(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(up), fmt, **limits))
    np.testing.assert_allclose(got, silu(g) * u, rtol=1e-5, atol=1e-6 * np.abs(silu(g) * u).max())


@pytest.mark.parametrize("fmt, m, n, k", [("q4_1", 7, 17, 64), ("q4_1", 130, 48, 576), ("q4_0", 64, 33, 2048)])
def test_gated_product_with_int8_tiles(fmt, m, n, k):
    """The one-pass gated product on 8-bit tiles (builds with AVX-512 VNNI): within the 8-bit products' bound
    (tests/cpu_kernels/test_quantized_matmul.py) carried through silu(g) * u, and the same as the plain kernel's two
    8-bit products combined."""
    from tests.cpu_kernels.test_quantized_matmul import int8_error_bound

    x, gate, up, want, _ = gated_case(fmt, m, n, k, seed=m + n)
    limits = dict(bf16_max_rows=bf16_max_rows(), int8_tile_min_rows=1)
    got = np.asarray(gated_matmul(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(up), fmt, **limits))
    g_w, u_w = (dequantize_blocks(raw, fmt).astype(np.float64) for raw in (gate, up))
    g, u = x.astype(np.float64) @ g_w.T, x.astype(np.float64) @ u_w.T
    g_err, u_err = int8_error_bound(x, gate, fmt), int8_error_bound(x, up, fmt)
    np.testing.assert_array_less(np.abs(got - want), 1.1 * g_err * (np.abs(u) + u_err) + np.abs(g) * u_err + 1e-30)
    plain_g, plain_u = (np.asarray(quantized_matmul(jnp.asarray(x), jnp.asarray(w), fmt, **limits), np.float64)
                        for w in (gate, up))
    np.testing.assert_allclose(got, silu(plain_g) * plain_u, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_gate_and_up_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="differ"):
        gated_matmul(jnp.zeros((2, 32)), jnp.zeros((4, 20), jnp.uint8), jnp.zeros((5, 20), jnp.uint8), "q4_1")
