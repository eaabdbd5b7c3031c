"""The native ragged paged attention (paged_attention.cc) as a JAX function, for XLA CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import load

HEAD_DIM_MULTIPLE = 16  # the kernel works in 16-float vectors

def paged_attention(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys (not in the pages yet)
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] float32, or bfloat16 stored as uint16 bits
    v_pages: jax.Array,  # [N, page, KVH, hd]
    query_start: jax.Array,  # [S] int32 flat index of each sequence's first token this step
    q_lens: jax.Array,  # [S] int32 tokens of each sequence this step (0: a padding row)
    kv_lens: jax.Array,  # [S] int32 context length after this step
    page_tables: jax.Array,  # [S, P] int32
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of every query over its sequence's cached pages and this step's own keys -> [T, H, hd]
    float32 (zero on padding tokens). Sequences are back to back in the flat tokens; with `sliding_window`, a query
    at position p sees keys at positions > p - window; with `soft_cap`, scores become cap * tanh(score / cap)."""
    if q.shape[-1] % HEAD_DIM_MULTIPLE:
        raise ValueError(f"the native paged attention needs head_dim a multiple of {HEAD_DIM_MULTIPLE}, got {q.shape[-1]}")
    load()
    call = jax.ffi.ffi_call("jvllm_paged_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ints = [x.astype(jnp.int32) for x in (query_start, q_lens, kv_lens, page_tables)]
    return call(*f32, k_pages, v_pages, *ints, scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))
