"""The `xla` backend: gather-based paged attention in plain jnp (the CPU default and the kernels' reference)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.attention.metadata import AttentionMetadata

_MASKED = -1e30  # finite, so fully padded rows give a harmless uniform softmax rather than NaN


def write_kv(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """pages [N, page, KVH, hd], new [T, KVH, hd], slot_mapping [T] -> pages with the tokens written.

    Token-major pages make this a row scatter over the leading axis, which XLA CPU does in place on a
    donated pool; a head-major pool was turned into a whole-pool copy per layer (measured ~200x slower)."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    flat = pages.reshape(num_pages * page_size, kv_heads, head_dim)
    return flat.at[slot_mapping].set(new.astype(pages.dtype)).reshape(pages.shape)


def write_layers(kv_cache: list, new_kv: list, md: AttentionMetadata) -> list:
    """Write every layer's new K/V [T, KVH, hd] into its pages. Run in its own jit with the pool donated:
    a jit that both gathers from and scatters into the pool makes XLA copy the whole pool each step."""
    return [(write_kv(k_pages, k, md.slot_mapping), write_kv(v_pages, v, md.slot_mapping))
            for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]


def gather_context(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """pages [N, page, KVH, hd], block_tables [S, P] -> [KVH, S, P * page, hd] contiguous context.

    Head-major context makes the attention einsums batch over (kv_head, seq) with contiguous tokens."""
    _, page_size, kv_heads, head_dim = pages.shape
    seqs, max_pages = block_tables.shape
    context = pages[block_tables].reshape(seqs, max_pages * page_size, kv_heads, head_dim)
    return context.transpose(2, 0, 1, 3)


def paged_attention(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys (not yet in the pages)
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] read only
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal attention of each query over its sequence's cached pages plus this step's chunk -> [T, H, hd].
    With `sliding_window`, a query at position p sees only keys at positions > p - window."""
    kv_heads = k_pages.shape[2]
    seqs, max_q = md.seq_token_index.shape
    group, head_dim = q.shape[1] // kv_heads, q.shape[2]
    q_padded = q[md.seq_token_index].reshape(seqs, max_q, kv_heads, group, head_dim)  # [S, Q, KVH, G, hd]
    chunk_k = k[md.seq_token_index].transpose(2, 0, 1, 3)  # [KVH, S, Q, hd]
    chunk_v = v[md.seq_token_index].transpose(2, 0, 1, 3)  # [KVH, S, Q, hd]
    keys = jnp.concatenate([gather_context(k_pages, md.block_tables), chunk_k.astype(k_pages.dtype)], axis=2)
    values = jnp.concatenate([gather_context(v_pages, md.block_tables), chunk_v.astype(v_pages.dtype)], axis=2)
    context_len = keys.shape[2] - max_q  # C: padded cached context, then Q chunk slots
    cached = md.kv_lens - md.q_lens  # [S] tokens already in the pages
    q_idx = jnp.arange(max_q)
    sees_context = jnp.arange(context_len)[None, None, :] < cached[:, None, None]  # [S, 1, C]
    sees_chunk = (q_idx[None, None, :] <= q_idx[None, :, None]) & (q_idx[None, None, :] < md.q_lens[:, None, None])
    visible = jnp.concatenate([jnp.broadcast_to(sees_context, (seqs, max_q, context_len)), sees_chunk], axis=2)
    if sliding_window is not None:
        q_pos = cached[:, None] + q_idx[None, :]  # [S, Q]
        k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(context_len), (seqs, context_len)),
                                 cached[:, None] + q_idx[None, :]], axis=1)  # [S, C + Q]
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
    scores = jnp.einsum("sqkgd,kscd->skgqc", q_padded, keys, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)  # [S, KVH, G, Q, C + Q]
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("skgqc,kscd->sqkgd", probs, values, preferred_element_type=jnp.float32)
    out = out.reshape(seqs, max_q, kv_heads * group, head_dim)  # [S, Q, H, hd]
    return out[md.token_seq, md.token_offset].astype(q.dtype)  # [T, H, hd]
