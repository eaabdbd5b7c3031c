"""The `xla` backend: gather-based paged attention in plain jnp (the CPU default and the kernels' reference)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import AttentionMetadata
from jvllm.attention.pool_storage import as_stored, as_values

# Decode-only steps take `decode_attention` (a loop over pages, faster than gathering whole contexts at every
# batch size measured: docs/design.md); steps with prefill chunks gather the context.
_MASKED = -1e30  # finite, so fully padded rows give a harmless uniform softmax rather than NaN


def write_kv(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """pages [N, page, KVH, hd], new [T, KVH, hd], slot_mapping [T] -> pages with the tokens written.

    Token-major pages make this a row scatter over the leading axis, which XLA CPU does in place on a
    donated pool; a head-major pool becomes a whole-pool copy per layer (docs/design.md).
    A bfloat16 pool may be stored as its bits (jvllm.attention.pool_storage)."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    flat = pages.reshape(num_pages * page_size, kv_heads, head_dim)
    return flat.at[slot_mapping].set(as_stored(new, pages.dtype)).reshape(pages.shape)


def write_layers(kv_cache: list, new_kv: list, md: AttentionMetadata) -> list:
    """Write every layer's new K/V [T, KVH, hd] into its pages. Run in its own jit with the pool donated:
    a jit that both gathers from and scatters into the pool makes XLA copy the whole pool each step."""
    return [(write_kv(k_pages, k, md.slot_mapping), write_kv(v_pages, v, md.slot_mapping))
            for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]


def gather_context(pages: jax.Array, page_tables: jax.Array) -> jax.Array:
    """pages [N, page, KVH, hd], page_tables [S, P] -> [S, KVH, P * page, hd] contiguous context.

    Sequence- then head-major context makes the attention einsums batch over (seq, kv_head) with contiguous
    tokens, in the order of their outputs."""
    _, page_size, kv_heads, head_dim = pages.shape
    seqs, max_pages = page_tables.shape
    context = as_values(pages[page_tables]).reshape(seqs, max_pages * page_size, kv_heads, head_dim)
    return context.transpose(0, 2, 1, 3)


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
    if max_q == 1:  # decode-only (static): stream pages, gather no context
        out = decode_attention(q[md.seq_token_index[:, 0]], k[md.seq_token_index[:, 0]], v[md.seq_token_index[:, 0]],
                               k_pages, v_pages, md.page_tables, md.kv_lens - md.q_lens, scale, sliding_window)
        return out[md.token_seq].astype(q.dtype)  # [T, H, hd]
    group, head_dim = q.shape[1] // kv_heads, q.shape[2]
    q_padded = q[md.seq_token_index].reshape(seqs, max_q, kv_heads, group, head_dim)  # [S, Q, KVH, G, hd]
    chunk_k = k[md.seq_token_index].transpose(0, 2, 1, 3)  # [S, KVH, Q, hd]
    chunk_v = v[md.seq_token_index].transpose(0, 2, 1, 3)  # [S, KVH, Q, hd]
    context_k, context_v = gather_context(k_pages, md.page_tables), gather_context(v_pages, md.page_tables)
    keys = jnp.concatenate([context_k, chunk_k.astype(context_k.dtype)], axis=2)  # [S, KVH, C + Q, hd]
    values = jnp.concatenate([context_v, chunk_v.astype(context_v.dtype)], axis=2)
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
    # Score rows in (q, g) order and K/V batched (seq, kv_head) as the outputs are: XLA CPU then moves only q's
    # KVH axis ahead of Q, a copy of contiguous [G, hd] runs (docs/design.md). The output keeps the
    # (seq, kv_head, q, g) order and is transposed afterwards: written straight as [S, Q, KVH, G, hd], XLA CPU
    # compiles a bf16 x bf16 dot its runtime cannot run ("Unsupported element type for DotThunk").
    scores = jnp.einsum("sqkgd,skcd->skqgc", q_padded, keys, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, :, None, :], scores, _MASKED)  # [S, KVH, Q, G, C + Q]
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("skqgc,skcd->skqgd", probs, values, preferred_element_type=jnp.float32)  # [S, KVH, Q, G, hd]
    out = out.transpose(0, 2, 1, 3, 4).reshape(seqs, max_q, kv_heads * group, head_dim)  # [S, Q, H, hd]
    return out[md.token_seq, md.token_offset].astype(q.dtype)  # [T, H, hd]


SINGLE_SEQUENCE_PAGES_PER_ITERATION = 16


def pages_per_iteration(seqs: int, max_pages: int) -> int:
    """Pages of each sequence that one `decode_attention` loop iteration reads (a divisor of max_pages).

    Two for a batch: each iteration's pages of every sequence stay in cache. Up to 16 for a single sequence,
    whose pages are few bytes, so that the loop's fixed cost per iteration (~10 small XLA ops) is paid a few
    times per layer rather than once per 2 pages (measurements in docs/design.md)."""
    per_iter = SINGLE_SEQUENCE_PAGES_PER_ITERATION if seqs == 1 else 2
    while max_pages % per_iter:
        per_iter //= 2
    return per_iter


def decode_attention(
    q: jax.Array,  # [S, H, hd] one query per sequence
    k: jax.Array,  # [S, KVH, hd] its own key (not yet in the pages)
    v: jax.Array,  # [S, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] read only
    v_pages: jax.Array,  # [N, page, KVH, hd]
    page_tables: jax.Array,  # [S, P]
    cached: jax.Array,  # [S] tokens in the pages before this one (0 for padding rows)
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Flash-decoding in jnp -> [S, H, hd] float32: an online softmax over the pages, a couple of pages per
    sequence per loop iteration, for as many iterations as the longest context needs. On XLA CPU this is
    ~40% faster than gathering every sequence's whole context (measured at batch 64, SmolLM2 shapes): no
    [KVH, S, C, hd] copy is materialised, and each iteration's pages stay in cache."""
    seqs, max_pages = page_tables.shape
    _, page_size, kv_heads, head_dim = k_pages.shape
    group = q.shape[1] // kv_heads
    per_iter = pages_per_iteration(seqs, max_pages)
    span = per_iter * page_size
    qg = q.reshape(seqs, kv_heads, group, head_dim).astype(jnp.float32) * scale  # [S, KVH, G, hd]
    own = jnp.einsum("skgd,skd->skg", qg, k.astype(jnp.float32))  # [S, KVH, G]: the own key is always visible
    acc0 = jnp.broadcast_to(v.astype(jnp.float32)[:, :, None, :], (seqs, kv_heads, group, head_dim))
    lowest = cached - sliding_window + 1 if sliding_window is not None else jnp.zeros_like(cached)  # [S]

    def one_span(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        running_max, denom, acc = carry  # [S, KVH, G], [S, KVH, G], [S, KVH, G, hd]
        pages = jax.lax.dynamic_slice_in_dim(page_tables, i * per_iter, per_iter, axis=1)  # [S, per]
        keys = as_values(k_pages[pages]).reshape(seqs, span, kv_heads, head_dim)  # [S, span, KVH, hd]
        values = as_values(v_pages[pages]).reshape(seqs, span, kv_heads, head_dim)
        scores = jnp.einsum("skgd,spkd->skgp", qg, keys, preferred_element_type=jnp.float32)  # [S, KVH, G, span]
        pos = i * span + jnp.arange(span)  # [span]
        visible = (pos[None, :] < cached[:, None]) & (pos[None, :] >= lowest[:, None])  # [S, span]
        scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        rescale = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max[..., None])
        denom = denom * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("skgp,spkd->skgd", probs.astype(values.dtype), values,
                                                    preferred_element_type=jnp.float32)
        return new_max, denom, acc

    num_spans = (jnp.max(cached) + span - 1) // span  # dynamic: padded pages past the longest context are skipped
    _, denom, acc = jax.lax.fori_loop(0, num_spans, one_span, (own, jnp.ones_like(own), acc0))
    return (acc / denom[..., None]).reshape(seqs, kv_heads * group, head_dim)
