"""RMSNorm and residual add + RMSNorm in one pass (rms_norm.cc) as JAX functions, for XLA CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import load


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] float32, weight [D] float32 -> weight * (x / sqrt(mean(x^2) + eps)) [..., D] float32."""
    load()
    call = jax.ffi.ffi_call("jvllm_rms_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="broadcast_all")
    return call(x, weight, eps=np.float32(eps))


def add_rms_norm(x: jax.Array, delta: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """x, delta [..., D] float32, weight [D] -> (s = x + delta, rms_norm(s, weight, eps)), in one pass per row."""
    load()
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    call = jax.ffi.ffi_call("jvllm_add_rms_norm", (out, out), vmap_method="broadcast_all")
    return call(x, delta, weight, eps=np.float32(eps))
