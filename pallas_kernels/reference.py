"""Pure-jnp references for the Pallas kernels: gather pages into a contiguous context, mask, softmax in f32.

The attention references are jitted: a caller outside jit (the kernel tests, each case with its own shapes) compiles
one program per call's shapes, not one per primitive and shape."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """pages [N, page, KVH, hd], block_tables [S, P] -> [S, P * page, KVH, hd] f32 contiguous context."""
    seqs, max_pages = block_tables.shape
    _, page_size, kv_heads, head_dim = pages.shape
    return pages[block_tables].reshape(seqs, max_pages * page_size, kv_heads, head_dim).astype(jnp.float32)


def _attend(
    q: jax.Array,  # [S, Q, H, hd] f32
    keys: jax.Array,  # [S, C, KVH, hd] f32
    values: jax.Array,  # [S, C, KVH, hd] f32
    visible: jax.Array,  # [S, Q, C] bool
    scale: float,
    soft_cap: float | None,
) -> jax.Array:
    """Masked softmax attention -> [S, Q, H, hd] f32; a row that sees no key gives zeros."""
    seqs, max_q, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    q = q.reshape(seqs, max_q, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("sqkgd,sckd->skgqc", q, keys, precision="highest") * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = visible[:, None, None]  # [S, 1, 1, Q, C]
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    values = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], values, 0.0)  # stale pool slots may be NaN
    out = jnp.einsum("skgqc,sckd->sqkgd", probs, values, precision="highest")
    return out.reshape(seqs, max_q, heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap"))
def decode_attention_reference(
    q: jax.Array,  # [S, H, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd]
    v_pages: jax.Array,  # [N, page, KVH, hd]
    block_tables: jax.Array,  # [S, P]
    lengths: jax.Array,  # [S]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Each sequence's single query sits at position length - 1 and sees keys [0, length) -> [S, H, hd]."""
    keys, values = gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables)
    k_pos = jnp.arange(keys.shape[1])[None, :]  # [1, C]
    q_pos = (lengths - 1)[:, None]  # [S, 1]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    out = _attend(q[:, None].astype(jnp.float32), keys, values, visible[:, None, :], scale, soft_cap)
    return out[:, 0].astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "max_q_len"))
def ragged_attention_reference(
    q: jax.Array,  # [T, H, hd] flat tokens of all sequences, back to back
    k_pages: jax.Array,  # [N, page, KVH, hd] already holding every query token's own K/V
    v_pages: jax.Array,  # [N, page, KVH, hd]
    query_start: jax.Array,  # [S] flat index of each sequence's first query token
    q_lens: jax.Array,  # [S]
    kv_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, P]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_q_len: int | None = None,
) -> jax.Array:
    """Query i of sequence s sits at position kv_len - q_len + i and sees keys at positions <= its own
    -> [T, H, hd]; tokens that belong to no sequence give zeros. Each sequence's queries are padded to
    `max_q_len` (static, >= every q_len; default T, which always holds them)."""
    num_tokens = q.shape[0]
    offsets = jnp.arange(max_q_len or num_tokens)[None, :]  # [1, Q]
    real = offsets < q_lens[:, None]  # [S, Q]
    flat = jnp.where(real, query_start[:, None] + offsets, num_tokens)  # [S, Q]; num_tokens = out of range
    q_seq = q.astype(jnp.float32)[jnp.minimum(flat, num_tokens - 1)]  # [S, Q, H, hd]
    keys, values = gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables)
    q_pos = (kv_lens - q_lens)[:, None] + offsets  # [S, Q]
    k_pos = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, C]
    visible = (k_pos <= q_pos[:, :, None]) & real[:, :, None]
    if sliding_window is not None:
        visible &= k_pos > q_pos[:, :, None] - sliding_window
    out = _attend(q_seq, keys, values, visible, scale, soft_cap)  # [S, Q, H, hd]
    result = jnp.zeros(q.shape, jnp.float32).at[flat.reshape(-1)].set(
        out.reshape(-1, *q.shape[1:]), mode="drop")
    return result.astype(q.dtype)


def write_kv_reference(
    pages: jax.Array,  # [N, page, KVH, hd]
    new: jax.Array,  # [T, KVH, hd]
    slot_mapping: jax.Array,  # [T] page * page_size + offset
) -> jax.Array:
    """Token t goes to page slot // page_size, row slot % page_size (sequentially, so the last write wins)."""
    page_size = pages.shape[1]

    def put(t, acc):
        slot = slot_mapping[t]
        return acc.at[slot // page_size, slot % page_size].set(new[t].astype(pages.dtype))

    return jax.lax.fori_loop(0, new.shape[0], put, pages)
