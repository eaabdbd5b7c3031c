"""The native RMSNorm and residual add + RMSNorm (cpu_kernels.rms_norm) against the models' jnp RMSNorm."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.rms_norm import add_rms_norm, rms_norm
from models.layers import RMSNorm, rms_normalized


@pytest.mark.parametrize("shape", [(1, 576), (31, 576), (33, 576), (300, 960), (4, 9, 64), (7, 100)])
def test_norms_match_the_jnp_norm(shape):
    """Rows of every count around the kernel's 32-row items (split over threads), sizes that leave vector tails,
    and a 3-D query-head layout; the sum is exact, the norm within float32 rounding of the sum of squares."""
    rng = np.random.default_rng(len(shape) * shape[-1] + shape[0])
    x, delta = (jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32) for _ in range(2))
    weight = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    got = jax.jit(lambda a, w: rms_norm(a, w, 1e-6))(x, weight)
    np.testing.assert_allclose(got, weight * rms_normalized(x, 1e-6), rtol=1e-5, atol=1e-5)
    total, normed = jax.jit(lambda a, b, w: add_rms_norm(a, b, w, 1e-6))(x, delta, weight)
    np.testing.assert_array_equal(total, x + delta)
    np.testing.assert_allclose(normed, weight * rms_normalized(x + delta, 1e-6), rtol=1e-5, atol=1e-5)


def test_the_model_norm_takes_the_kernel_on_cpu_and_keeps_its_results():
    """RMSNorm calls the native kernel for float32 on CPU (one custom call, no reduction of XLA's), and bfloat16
    inputs keep the jnp norm."""
    norm = RMSNorm(64, 1e-5, jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)), jnp.float32)
    text = jax.jit(lambda a, b: norm.add_and_norm(a, b)).lower(x, x).as_text()
    assert "jvllm_add_rms_norm" in text
    total, normed = norm.add_and_norm(x, x)
    np.testing.assert_allclose(normed, rms_normalized(2 * x, 1e-5), rtol=1e-5, atol=1e-5)
    assert "jvllm_rms_norm" not in jax.jit(norm).lower(x.astype(jnp.bfloat16)).as_text()
