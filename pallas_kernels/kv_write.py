"""Writing a step's new K/V into the token-major page pool: an XLA scatter (default) or a Pallas kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def write_kv_scatter(
    pages: jax.Array,  # [N, page, KVH, hd]
    new: jax.Array,  # [T, KVH, hd]
    slot_mapping: jax.Array,  # [T] int32 page * page_size + offset
) -> jax.Array:
    """Row scatter over the flattened (page, offset) axis. Inside a jit that donates the pool, XLA GPU
    updates the buffer in place, so only the T new rows move."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    flat = pages.reshape(num_pages * page_size, kv_heads, head_dim)
    return flat.at[slot_mapping].set(new.astype(pages.dtype)).reshape(pages.shape)


def _write_kernel(new_ref, slot_ref, _pages_in_ref, pages_ref):
    token, kv_head = pl.program_id(0), pl.program_id(1)
    slot = slot_ref[token]
    page_size = pages_ref.shape[1]
    row = new_ref[token, kv_head, :]  # [hd]
    pages_ref[jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size), kv_head, :] = row.astype(pages_ref.dtype)


def write_kv_kernel(
    pages: jax.Array,  # [N, page, KVH, hd]
    new: jax.Array,  # [T, KVH, hd]
    slot_mapping: jax.Array,  # [T] int32
    *,
    interpret: bool | None = None,
) -> jax.Array:
    """One program per (token, KV head) stores a head_dim row; the pool is aliased in and out, so under a
    donating jit nothing else is copied. Padding tokens all hit slot 0 (the reserved dump page)."""
    num_tokens, kv_heads, head_dim = new.shape
    common.check_pow2(head_dim=head_dim)
    return pl.pallas_call(
        _write_kernel,
        out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
        grid=(num_tokens, kv_heads),
        input_output_aliases={2: 0},
        interpret=common.resolve_interpret(interpret),
        compiler_params=common.compiler_params(num_warps=1, num_stages=1),
        name="jvllm_write_kv",
    )(new, slot_mapping.astype(jnp.int32), pages)


def write_kv(
    k_pages: jax.Array,  # [N, page, KVH, hd]
    v_pages: jax.Array,  # [N, page, KVH, hd]
    k: jax.Array,  # [T, KVH, hd]
    v: jax.Array,  # [T, KVH, hd]
    slot_mapping: jax.Array,  # [T] int32
    *,
    method: str = "scatter",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write both pools; `method` is 'scatter' (XLA) or 'kernel' (Pallas). Which is faster needs a GPU."""
    if method == "scatter":
        return write_kv_scatter(k_pages, k, slot_mapping), write_kv_scatter(v_pages, v, slot_mapping)
    if method == "kernel":
        return (write_kv_kernel(k_pages, k, slot_mapping, interpret=interpret),
                write_kv_kernel(v_pages, v, slot_mapping, interpret=interpret))
    raise ValueError(f"unknown KV write method {method!r}; use 'scatter' or 'kernel'")
