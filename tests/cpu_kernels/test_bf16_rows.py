"""The native one-row products with bfloat16 weights (cpu_kernels.bf16_rows, models.bf16_rows) against float64
products of the same bf16 weights; where the models and the engine take them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_kernels.bf16_rows import bf16_rows_max, bf16_rows_preferred, bf16_rows_product
from models.bf16_rows import native_bf16_rows
from models.layers import Linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (100, 37), (64, 300), (33, 129), (31, 17), (5, 40),
                                  (2052, 70), (3100, 23), (64, 4100)])
@pytest.mark.parametrize("out_in", [False, True], ids=["in_out", "out_in"])
def test_products_are_the_bf16_weights_in_float32(rows, k, n, out_in):
    """Sizes around the kernel's items (whole multiples of 16 outputs of [N, K] weights, 1-4 a thread, the last one
    short at N = 4,100; one row of x with K over 3,072 read eight outputs at a time; slices of K of [K, N] ones, read
    8 rows a pass: K under 8 or not a multiple of it), its 32-weight loads (K or N not a multiple of 32, or under 32)
    and row counts: within float32 summation of the exact products."""
    rng = np.random.default_rng(k * n + rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)  # [K, N]
    got = jax.jit(lambda a, b: bf16_rows_product(a, b, out_in))(x, w.T if out_in else w)
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)  # [M, N]
    magnitude = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w.astype(jnp.float32), np.float64))
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(got) - want) <= 4 * k * 2.0 ** -24 * magnitude + 1e-30)


def test_more_rows_than_the_kernel_takes_are_refused():
    x = jnp.ones((bf16_rows_max() + 1, 32), jnp.float32)
    with pytest.raises(Exception, match="at most 4 rows"):
        jax.block_until_ready(bf16_rows_product(x, jnp.ones((32, 8), jnp.bfloat16), False))


@pytest.mark.parametrize("d_in, d_out", [(64, 160), (160, 64)])
def test_a_linear_takes_the_kernel_for_the_preferred_rows_only_where_allowed(d_in, d_out):
    """Up to bf16_rows_preferred() rows with bf16 weights inside native_bf16_rows(True): one custom call, the
    float32 product of the bf16 weights (stored [out, in] for a narrowing kernel, as the batched copy does); more
    rows, or outside it: XLA."""
    layer = Linear(d_in, d_out, bias=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer.bias = nnx.Param(jnp.asarray(np.random.default_rng(1).standard_normal(d_out), jnp.bfloat16))
    if d_in > d_out:
        layer.kernel = nnx.Param(layer.kernel[...].T)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, d_in)), jnp.float32)

    def text(rows_x, enabled):
        with native_bf16_rows(enabled):
            return jax.jit(lambda a: layer(a)).lower(rows_x).as_text()

    preferred = bf16_rows_preferred()
    assert "jvllm_bf16_rows" in text(x, True)
    assert "jvllm_bf16_rows" not in text(x, False)
    assert ("jvllm_bf16_rows" in text(jnp.concatenate([x, x]), True)) == (preferred >= 2)
    assert "jvllm_bf16_rows" not in text(jnp.concatenate([x] * (preferred + 1)), True)
    x = jnp.concatenate([x * (i + 1) for i in range(preferred)])  # the most rows the kernel takes here
    with native_bf16_rows(True):
        got = np.asarray(jax.jit(lambda a: layer(a))(x))
    kernel = np.asarray(layer.kernel[...].astype(jnp.float32), np.float64)
    kernel = kernel.T if d_in > d_out else kernel  # [in, out]
    want = np.asarray(x, np.float64) @ kernel + np.asarray(layer.bias[...].astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
