"""The native ragged paged attention (paged_attention.cc) as a JAX function, for XLA CPU."""
from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import load

HEAD_DIM_MULTIPLE = 16  # the kernel works in 16-float vectors
DIRECT_QUERIES = 8  # a sequence's queries up to which the direct loops run by default (page_view.h kDirectQueries)
MOST_DIRECT_QUERIES = 32  # the most a call may ask for (kBlockQueries)


def bf16_prefill_tiles() -> bool:
    """Whether this machine's build can attend prefill blocks (more than 8 queries of a sequence) over bfloat16 pages
    with bf16 dot products (AVX-512 BF16), where a call allows it (`bf16_tiles`): queries and probabilities rounded
    to bfloat16, sums in float32."""
    return bool(load().JvllmBf16PrefillTiles())


def e5m2_to_bf16_bits(codes: np.ndarray) -> np.ndarray:
    """e5m2 bytes [n] (uint8) -> the bfloat16 bits [n] (uint16) the kernels read them as (fp8_rows.h)."""
    codes = np.ascontiguousarray(codes, np.uint8)
    out = np.empty(codes.shape, np.uint16)
    load().JvllmE5m2ToBf16(codes.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(codes.size),
                           out.ctypes.data_as(ctypes.c_void_p))
    return out


def paged_attention(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys (not in the pages yet)
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] float32, bfloat16 stored as uint16 bits, or float8_e5m2
    v_pages: jax.Array,  # [N, page, KVH, hd]
    query_start: jax.Array,  # [S] int32 flat index of each sequence's first token this step
    q_lens: jax.Array,  # [S] int32 tokens of each sequence this step (0: a padding row)
    kv_lens: jax.Array,  # [S] int32 context length after this step
    page_tables: jax.Array,  # [S, P] int32
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    bf16_tiles: bool = False,
    direct_queries: int = DIRECT_QUERIES,
) -> jax.Array:
    """Causal attention of every query over its sequence's cached pages and this step's own keys -> [T, H, hd]
    float32 (zero on padding tokens). Sequences are back to back in the flat tokens; with `sliding_window`, a query
    at position p sees keys at positions > p - window; with `soft_cap`, scores become cap * tanh(score / cap). With
    `bf16_tiles`, prefill blocks over bfloat16 pages may round queries and probabilities to bfloat16
    (`bf16_prefill_tiles`); otherwise the sums keep float32 queries and probabilities. A sequence of up to
    `direct_queries` queries (DIRECT_QUERIES to MOST_DIRECT_QUERIES) takes the loops that give every query the bits
    it would get alone (speculative decoding's verification rows)."""
    if q.shape[-1] % HEAD_DIM_MULTIPLE:
        raise ValueError(f"the native paged attention needs head_dim a multiple of {HEAD_DIM_MULTIPLE}, got {q.shape[-1]}")
    load()
    call = jax.ffi.ffi_call("jvllm_paged_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ints = [x.astype(jnp.int32) for x in (query_start, q_lens, kv_lens, page_tables)]
    return call(*f32, k_pages, v_pages, *ints, scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), bf16_tiles=np.int64(bf16_tiles),
                direct_queries=np.int64(direct_queries))


def paged_attention_write(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys
    v: jax.Array,  # [T, KVH, hd]
    k_store: jax.Array,  # [T, KVH, hd] the keys as the pages store them (the pages' dtype; float32 for bf16 pages)
    v_store: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] donated: returned with the step's keys written
    v_pages: jax.Array,  # [N, page, KVH, hd]
    query_start: jax.Array,  # [S] int32
    q_lens: jax.Array,  # [S] int32
    kv_lens: jax.Array,  # [S] int32
    page_tables: jax.Array,  # [S, P] int32
    slot_mapping: jax.Array,  # [T] int32 page * page_size + offset of each token (outside the pool: not written)
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    bf16_tiles: bool = False,
    direct_queries: int = DIRECT_QUERIES,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`paged_attention` that first writes the step's K/V into the pages at `slot_mapping`, in place (the pages
    are aliased to the outputs) -> (out [T, H, hd] float32, k_pages, v_pages)."""
    if q.shape[-1] % HEAD_DIM_MULTIPLE:
        raise ValueError(f"the native paged attention needs head_dim a multiple of {HEAD_DIM_MULTIPLE}, got {q.shape[-1]}")
    rounds = k_pages.dtype == jnp.uint16 and k_store.dtype == v_store.dtype == jnp.float32  # bf16 bits: rounded
    if not rounds and (k_store.dtype != k_pages.dtype or v_store.dtype != v_pages.dtype):
        raise ValueError(f"K/V to store must have the pages' dtype {k_pages.dtype}, got {k_store.dtype}")
    load()
    outs = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call("jvllm_paged_attention_write", outs, input_output_aliases={5: 1, 6: 2})
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ints = [x.astype(jnp.int32) for x in (query_start, q_lens, kv_lens, page_tables, slot_mapping)]
    return call(*f32, k_store, v_store, k_pages, v_pages, *ints, scale=np.float32(scale),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
                bf16_tiles=np.int64(bf16_tiles), direct_queries=np.int64(direct_queries))
