"""The native quantized matmul (cpu_kernels/quantized_matmul.cc) and the jnp dequantization (models.quantized)
against gguf's reference dequantizer followed by a float64 product, for every block format, row count (the
in-register path for one row, the tiled path beyond) and ragged output widths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import quantized_matmul
from jvllm.model_loader.gguf_blocks import dequantize_blocks
from models.quantized import FORMATS, dequantize, dequantized_rows, quantize_reference, quantized_dot

pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF blocks of random weights, with some rows scaled far apart (the scales differ by 10^4)."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n, k)).astype(np.float32)
    weights *= np.float32(10.0) ** rng.integers(-3, 2, size=(n, 1)).astype(np.float32)
    return quantize_reference(weights, fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 64), (33, 576), (130, 96)])
def test_kernel_matches_dequantize_then_float64_matmul(fmt, m, n, k):
    raw = random_blocks(fmt, n, k, seed=m * 1000 + n)
    x = np.random.default_rng(n).standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_blocks(raw, fmt).astype(np.float64).T
    got = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt))(x, raw))
    assert got.shape == (m, n) and got.dtype == np.float32
    scale = np.abs(x).astype(np.float64) @ np.abs(dequantize_blocks(raw, fmt)).astype(np.float64).T
    np.testing.assert_array_less(np.abs(got - want), 1e-6 * scale + 1e-30)  # float32 sums: ~K ulps of |x| |w|


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 64), (33, 576), (130, 96)])
def test_int16_activation_path_stays_within_its_precision(fmt, m, n, k):
    """Activations quantized to int16 per block of 32 (one scale each): each product is within a few 1e-5 of
    max|x| . sum|w| per block, far below float32-vs-bfloat16 differences."""
    raw = random_blocks(fmt, n, k, seed=m * 77 + n)
    x = np.random.default_rng(k).standard_normal((m, k)).astype(np.float32)
    x[:, :32] *= 1e4  # one block far larger than the rest: each block has its own scale
    w = dequantize_blocks(raw, fmt).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    got = np.asarray(jax.jit(lambda a, b: quantized_matmul(a, b, fmt, int16_max_rows=8))(x, raw))
    block_max = np.abs(x).reshape(m, k // 32, 32).max(-1)  # [m, blocks]
    bound = block_max @ np.abs(w).reshape(n, k // 32, 32).sum(-1).T / 32767  # half a step per element, summed
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-6 * np.abs(x) @ np.abs(w).T + 1e-30)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_jnp_dequantize_is_the_reference_bit_for_bit(fmt):
    raw = random_blocks(fmt, 40, 160, seed=7)
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(raw), fmt, 160)), dequantize_blocks(raw, fmt))
    ids = jnp.asarray([3, 0, 39, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(dequantized_rows(jnp.asarray(raw), ids, fmt, 160)),
                                  dequantize_blocks(raw, fmt)[[3, 0, 39, 3]])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_xla_fallback_gives_the_kernels_products(fmt, monkeypatch):
    """Where the kernel does not run (another backend), quantized_dot dequantizes in the step instead (16 rows: the
    kernel's float path, past its int16 rows)."""
    from models import quantized

    raw = jnp.asarray(random_blocks(fmt, 48, 96, seed=3))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 96)).astype(np.float32))
    native = np.asarray(jax.jit(lambda a, b: quantized_dot(a, b, fmt))(x, raw))
    monkeypatch.setattr(quantized, "native_kernel_available", lambda: False)
    fallback = np.asarray(jax.jit(lambda a, b: quantized_dot(a, b, fmt))(x, raw))
    np.testing.assert_allclose(native, fallback, rtol=1e-5, atol=1e-5 * np.abs(fallback).max())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="needs a weight of 20 bytes a row"):
        quantized_matmul(jnp.zeros((1, 32)), jnp.zeros((4, 34), jnp.uint8), "q4_1")
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        FORMATS["q8_0"].row_bytes(48)
