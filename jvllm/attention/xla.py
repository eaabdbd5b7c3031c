"""The `xla` backend: gather-based paged attention in plain jnp (the CPU default and the kernels' reference)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention.pool_storage import as_stored, as_values
from models.attention import EIGHT_BIT_POOLS, AttentionMetadata

# Decode steps take `decode_attention`, a loop over pages (faster than gathering whole contexts at every batch
# size measured: docs/design/step_shapes.md). Prefill steps put chunks of similar length side by side, one per row
# (`class_attention`), so that a step's shape depends on its token count alone.
MIN_CLASS_WIDTH = 16
_MASKED = -1e30  # finite, so fully padded rows give a harmless uniform softmax rather than NaN


def write_kv(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """pages [N, page, KVH, hd], new [T, KVH, hd], slot_mapping [T] -> pages with the tokens written.

    Token-major pages make this a row scatter over the leading axis, which XLA CPU does in place on a
    donated pool; a head-major pool becomes a whole-pool copy per layer (docs/design/step_shapes.md).
    A bfloat16 pool may be stored as its bits (jvllm.attention.pool_storage)."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    flat = pages.reshape(num_pages * page_size, kv_heads, head_dim)
    return flat.at[slot_mapping].set(as_stored(new, pages.dtype)).reshape(pages.shape)


def write_layers(kv_cache: list, new_kv: list, md: AttentionMetadata) -> list:
    """Write every layer's new K/V [T, KVH, hd] into its pages. Run in its own jit with the pool donated:
    a jit that both gathers from and scatters into the pool makes XLA copy the whole pool each step."""
    return [(write_kv(k_pages, k, md.slot_mapping), write_kv(v_pages, v, md.slot_mapping))
            for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]


def capped(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Scaled scores squashed into (-soft_cap, soft_cap) by tanh (Gemma 2's attention soft-cap), or unchanged."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def online_softmax_step(running_max: jax.Array, denom: jax.Array, acc: jax.Array, scores: jax.Array,
                        values: jax.Array, pv_spec: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds one span of masked scores [..., span] and its values into the running (max, denom, acc)."""
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    rescale = jnp.exp(running_max - new_max)
    probs = jnp.exp(scores - new_max[..., None])
    denom = denom * rescale + probs.sum(axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum(pv_spec, probs.astype(values.dtype), values,
                                                preferred_element_type=jnp.float32)
    return new_max, denom, acc


def paged_attention(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys (not yet in the pages)
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] read only
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of each query over its sequence's cached pages plus this step's chunk -> [T, H, hd].
    With `sliding_window`, a query at position p sees only keys at positions > p - window; with `soft_cap`,
    scores become soft_cap * tanh(score / soft_cap) (Gemma 2). Over 8-bit pages the step's own K/V are attended
    rounded as the pages will keep them, like every cached key."""
    if k_pages.dtype in EIGHT_BIT_POOLS:
        k, v = as_values(as_stored(k, k_pages.dtype)), as_values(as_stored(v, v_pages.dtype))
    if md.decode:  # one token per row, row s is token s
        out = decode_attention(q, k, v, k_pages, v_pages, md.page_tables, md.cached_lens, scale, sliding_window,
                               soft_cap)
        return out.astype(q.dtype)
    out = jnp.zeros(q.shape, jnp.float32)  # [T, H, hd]
    for width in sorted(int(key[len("index"):]) for key in md.layout if key.startswith("index")):
        index, rows, count = md.layout[f"index{width}"], md.layout[f"rows{width}"], md.layout[f"count{width}"]

        def attend(out: jax.Array, index: jax.Array = index, rows: jax.Array = rows) -> jax.Array:
            found = class_attention(q, k, v, k_pages, v_pages, md, index, rows, scale, sliding_window, soft_cap)
            return out.at[index.reshape(-1)].set(found, mode="drop")  # padding slots index T: dropped

        out = jax.lax.cond(count > 0, attend, lambda out: out, out)  # a class no chunk uses costs nothing
    return out.astype(q.dtype)


def class_attention(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd]
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd]
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    index: jax.Array,  # [R, W] int32 flat token of each chunk's w-th query (T where a row is shorter or unused)
    rows: jax.Array,  # [R] int32 the metadata row (sequence) of each chunk
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of R chunks of up to W tokens, one per row -> [R * W, H, hd] float32 (rows in `index` order).

    Each chunk attends to itself densely (causal) and to its cached pages in a loop over page spans, with
    one online softmax over both. Scores are laid out (seq, kv_head) x (query, group) x keys, the order
    of the outputs, so XLA CPU only moves whole [G, hd] runs."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    num_rows, width = index.shape
    valid = index < num_tokens  # [R, W]
    safe = jnp.minimum(index, num_tokens - 1)
    q_rows = q[safe].reshape(num_rows, width, kv_heads, group, head_dim)  # [R, W, KVH, G, hd]
    own_k = k[safe].transpose(0, 2, 1, 3)  # [R, KVH, W, hd]
    own_v = v[safe].transpose(0, 2, 1, 3)
    cached = jnp.where(valid[:, 0], md.cached_lens[rows], 0)  # [R]
    offset = jnp.arange(width)
    visible = (offset[None, :] <= offset[:, None])[None] & valid[:, None, :]  # [R, W (query), W (key)]
    if sliding_window is not None:
        visible &= (offset[:, None] - offset[None, :] < sliding_window)[None]
    scores = capped(jnp.einsum("rqkgd,rkcd->rkqgc", q_rows, own_k, preferred_element_type=jnp.float32) * scale,
                    soft_cap)
    scores = jnp.where(visible[:, None, :, None, :], scores, _MASKED)  # [R, KVH, W, G, W]
    running_max = scores.max(axis=-1)  # [R, KVH, W, G]: the own key is always visible
    probs = jnp.exp(scores - running_max[..., None])
    denom = probs.sum(axis=-1)
    acc = jnp.einsum("rkqgc,rkcd->rkqgd", probs.astype(own_v.dtype), own_v, preferred_element_type=jnp.float32)

    tables = md.page_tables[rows]  # [R, P]
    per_iter = pages_per_iteration(num_rows, tables.shape[1])
    _, page_size, _, _ = k_pages.shape
    span = per_iter * page_size
    q_pos = cached[:, None] + offset[None, :]  # [R, W]

    def one_span(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        running_max, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, i * per_iter, per_iter, axis=1)  # [R, per]
        keys = as_values(k_pages[pages]).reshape(num_rows, span, kv_heads, head_dim)  # [R, span, KVH, hd]
        values = as_values(v_pages[pages]).reshape(num_rows, span, kv_heads, head_dim)
        k_pos = i * span + jnp.arange(span)  # [span]
        seen = (k_pos[None, None, :] < cached[:, None, None]) & valid[:, :, None]  # [R, W, span]
        if sliding_window is not None:
            seen &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
        scores = capped(jnp.einsum("rqkgd,rpkd->rkqgp", q_rows, keys, preferred_element_type=jnp.float32) * scale,
                        soft_cap)
        scores = jnp.where(seen[:, None, :, None, :], scores, _MASKED)  # [R, KVH, W, G, span]
        return online_softmax_step(running_max, denom, acc, scores, values, "rkqgp,rpkd->rkqgd")

    num_spans = (jnp.max(cached) + span - 1) // span  # dynamic: no iteration for chunks without context
    _, denom, acc = jax.lax.fori_loop(0, num_spans, one_span, (running_max, denom, acc))
    out = acc / denom[..., None]  # [R, KVH, W, G, hd]
    return out.transpose(0, 2, 1, 3, 4).reshape(num_rows * width, heads, head_dim)


def chunk_classes(num_tokens: int) -> list[int]:
    """The chunk widths of a prefill step of `num_tokens` tokens: a chunk of n tokens goes to the smallest
    width >= n (powers of two from 16, the last num_tokens itself)."""
    widths, width = [], min(MIN_CLASS_WIDTH, num_tokens)
    while width < num_tokens:
        widths.append(width)
        width *= 2
    return widths + [num_tokens]


def class_capacity(width: int, narrowest: int, num_tokens: int, num_seqs: int) -> int:
    """Rows of a class: every chunk of a class but the narrowest is longer than half its width."""
    if width == narrowest:
        return min(num_seqs, num_tokens)
    return max(1, min(num_seqs, num_tokens // (width // 2 + 1)))


def class_layout(q_lens: np.ndarray, query_start: np.ndarray, cached: np.ndarray, num_tokens: int,
                 num_seqs: int) -> dict[str, np.ndarray]:
    """Host side of `paged_attention` for a prefill step: per chunk class, each chunk's flat tokens in a row."""
    del cached  # the attention reads it from the metadata
    widths = chunk_classes(num_tokens)
    chosen = np.searchsorted(np.asarray(widths), q_lens)  # the class of each chunk
    layout: dict[str, np.ndarray] = {}
    for c, width in enumerate(widths):
        capacity = class_capacity(width, widths[0], num_tokens, num_seqs)
        members = np.flatnonzero(chosen == c)
        index = np.full((capacity, width), num_tokens, np.int32)
        rows = np.zeros(capacity, np.int32)
        for r, member in enumerate(members):
            index[r, : q_lens[member]] = query_start[member] + np.arange(q_lens[member])
            rows[r] = member
        layout[f"index{width}"], layout[f"rows{width}"] = index, rows
        layout[f"count{width}"] = np.asarray(len(members), np.int32)
    return layout


SINGLE_SEQUENCE_PAGES_PER_ITERATION = 16


def pages_per_iteration(seqs: int, max_pages: int) -> int:
    """Pages of each sequence that one `decode_attention` loop iteration reads (a divisor of max_pages).

    Two for a batch: each iteration's pages of every sequence stay in cache. Up to 16 for a single sequence,
    whose pages are few bytes, so that the loop's fixed cost per iteration (~10 small XLA ops) is paid a few
    times per layer rather than once per 2 pages (measurements in docs/design/step_shapes.md)."""
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
    soft_cap: float | None = None,
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
    own = capped(jnp.einsum("skgd,skd->skg", qg, k.astype(jnp.float32)), soft_cap)  # [S, KVH, G]: always visible
    acc0 = jnp.broadcast_to(v.astype(jnp.float32)[:, :, None, :], (seqs, kv_heads, group, head_dim))
    lowest = cached - sliding_window + 1 if sliding_window is not None else jnp.zeros_like(cached)  # [S]

    def one_span(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        running_max, denom, acc = carry  # [S, KVH, G], [S, KVH, G], [S, KVH, G, hd]
        pages = jax.lax.dynamic_slice_in_dim(page_tables, i * per_iter, per_iter, axis=1)  # [S, per]
        keys = as_values(k_pages[pages]).reshape(seqs, span, kv_heads, head_dim)  # [S, span, KVH, hd]
        values = as_values(v_pages[pages]).reshape(seqs, span, kv_heads, head_dim)
        scores = capped(jnp.einsum("skgd,spkd->skgp", qg, keys, preferred_element_type=jnp.float32), soft_cap)
        pos = i * span + jnp.arange(span)  # [span]
        visible = (pos[None, :] < cached[:, None]) & (pos[None, :] >= lowest[:, None])  # [S, span]
        scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
        return online_softmax_step(running_max, denom, acc, scores, values, "skgp,spkd->skgd")

    num_spans = (jnp.max(cached) + span - 1) // span  # dynamic: padded pages past the longest context are skipped
    _, denom, acc = jax.lax.fori_loop(0, num_spans, one_span, (own, jnp.ones_like(own), acc0))
    return (acc / denom[..., None]).reshape(seqs, kv_heads * group, head_dim)
