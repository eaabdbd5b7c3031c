"""q, k and v from a fused projection's output with RoPE applied to q and k in one pass (rope.cc), for XLA CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import load


def rope_qkv(qkv: jax.Array, cos: jax.Array, sin: jax.Array, heads: int,
             kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [T, (heads + 2 kv_heads) hd] float32 (columns [q | k | v]), cos and sin [T, rotary] float32 (rotary even,
    at most hd) -> (q [T, heads, hd], k [T, kv_heads, hd], v [T, kv_heads, hd]) float32: q and k rotated as
    models.rope.apply_rotary rotates them (the halves of each head's first `rotary` dims), v as it is."""
    load()
    tokens, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    outs = (jax.ShapeDtypeStruct((tokens, heads, hd), jnp.float32),
            jax.ShapeDtypeStruct((tokens, kv_heads, hd), jnp.float32),
            jax.ShapeDtypeStruct((tokens, kv_heads, hd), jnp.float32))
    call = jax.ffi.ffi_call("jvllm_rope_qkv", outs, vmap_method="sequential")
    return call(qkv, cos, sin, heads=np.int64(heads), kv_heads=np.int64(kv_heads))
