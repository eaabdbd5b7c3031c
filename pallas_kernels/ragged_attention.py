"""Ragged paged attention (prefill / mixed): a flat batch of sequences' query chunks, causal over their pages.

The grid walks work items, each `block_q` query tokens of one sequence, listed by the host (`ragged_items`): a
step of T tokens and S sequences has at most cdiv(T, block_q) + S of them, so the grid depends on (T, S) alone."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common, launch


def _ragged_kernel(
    q_ref,  # [T, H, hd]
    k_pages_ref,  # [N, page, KVH, hd]
    v_pages_ref,  # [N, page, KVH, hd]
    block_tables_ref,  # [S, P_pad]
    query_start_ref,  # [S]
    q_lens_ref,  # [S]
    kv_lens_ref,  # [S]
    item_seq_ref,  # [NB] the sequence of each work item
    item_first_ref,  # [NB] its first query's offset in the sequence's chunk (>= q_len: nothing to do)
    *refs,  # optional aliased initial output, then out [T, H, hd]
    group: int,
    group_rows: int,
    block_q: int,
    pages_per_block: int,
    qk_chunks: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    out_ref = refs[-1]
    item, kv_head = pl.program_id(0), pl.program_id(1)
    seq = item_seq_ref[item]
    q_len = q_lens_ref[seq]
    first_q = pl.multiple_of(item_first_ref[item], block_q)  # this program's first query offset within the sequence

    @pl.when(first_q < q_len)
    def _():
        head_dim = q_ref.shape[2]
        block_k = pages_per_block * k_pages_ref.shape[1]
        rows = block_q * group_rows
        kv_len = kv_lens_ref[seq]
        cached = kv_len - q_len
        # [BQ tokens, G heads, hd] block, flattened to rows (token-major) so one tl.dot serves the group
        tokens = pl.ds(query_start_ref[seq] + first_q, block_q)
        heads = pl.ds(kv_head * group, group_rows)
        row_ok = (first_q + jnp.arange(block_q) < q_len)[:, None, None]
        if group_rows != group:
            row_ok = row_ok & (jnp.arange(group_rows) < group)[None, :, None]
        io_mask = jnp.broadcast_to(row_ok, (block_q, group_rows, head_dim))
        # q (and each key block below) in `qk_chunks` head-dim slices, loaded separately: [R, hd / qk_chunks]
        width = head_dim // qk_chunks
        columns = [pl.ds(c * width, width) for c in range(qk_chunks)]
        chunk_mask = jnp.broadcast_to(row_ok, (block_q, group_rows, width))
        q = [pltriton.load(q_ref.at[tokens, heads, cols], mask=chunk_mask, other=0).reshape(rows, width)
             for cols in columns]
        q_pos = cached + first_q + jax.lax.div(jnp.arange(rows), group_rows)  # [R] absolute positions

        last_pos = cached + jnp.minimum(first_q + block_q, q_len) - 1
        hi = common.cdiv(last_pos + 1, block_k)  # causal: no block beyond the block's last query
        lo = 0
        if sliding_window is not None:
            lo = jax.lax.div(jnp.maximum(cached + first_q - sliding_window + 1, 0), block_k)

        def body(block, carry):
            k_pos = block * block_k + jnp.arange(block_k)  # [BK]
            valid = k_pos < kv_len
            k = [common.load_kv_block(k_pages_ref, block_tables_ref, seq, kv_head, block, pages_per_block, None, cols)
                 for cols in columns]
            v = common.load_kv_block(v_pages_ref, block_tables_ref, seq, kv_head, block, pages_per_block, valid)
            visible = (k_pos[None, :] <= q_pos[:, None]) & valid[None, :]  # [R, BK]
            if sliding_window is not None:
                visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
            return common.online_softmax_step(carry, q, k, v, visible, scale, soft_cap)

        init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), common.MASK_VALUE, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        o, _, l = jax.lax.fori_loop(lo, hi, body, init)
        o = o / jnp.where(l > 0, l, 1.0)[:, None]
        out = o.reshape(block_q, group_rows, head_dim).astype(out_ref.dtype)
        pltriton.store(out_ref.at[tokens, heads, :], out, mask=io_mask)


def ragged_block_q(q_dtype, kv_dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Query tokens per program: the launch table's rows of (token, head) over the padded GQA group, and at
    least 16 rows for tl.dot."""
    group_rows = common.next_pow2(num_heads // num_kv_heads)
    target_rows = launch.ragged_launch(q_dtype, kv_dtype, head_dim).block_rows
    return max(1, target_rows // group_rows, 16 // group_rows)


def ragged_items(q_lens, block_q: int, num_tokens: int, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side: (item_seq, item_first) [cdiv(num_tokens, block_q) + num_seqs] int32, one item per block_q
    queries of each sequence with q_lens[s] > 0; unused items have item_first = num_tokens (never runs)."""
    num_items = common.cdiv(num_tokens, block_q) + num_seqs
    item_seq = np.zeros(num_items, np.int32)
    item_first = np.full(num_items, num_tokens, np.int32)
    counts = -(-np.asarray(q_lens, np.int64) // block_q)  # [S] items of each sequence, in sequence order
    used = int(counts.sum())
    item_seq[:used] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    # each item's index within its sequence's items, times block_q
    item_first[:used] = (np.arange(used) - np.repeat(np.cumsum(counts) - counts, counts)) * block_q
    return item_seq, item_first


def ragged_paged_attention(
    q: jax.Array,  # [T, H, hd] flat query tokens, sequences back to back (padding tokens at the end)
    k_pages: jax.Array,  # [N, page, KVH, hd] already holding every query token's own K/V
    v_pages: jax.Array,  # [N, page, KVH, hd]
    query_start: jax.Array,  # [S] int32 flat index of each sequence's first token (cu_q_lens[:-1])
    q_lens: jax.Array,  # [S] int32 query tokens per sequence (0 for padded rows)
    kv_lens: jax.Array,  # [S] int32 keys per sequence, its query tokens included
    block_tables: jax.Array,  # [S, P] int32 page ids (0 when padded)
    item_seq: jax.Array,  # [NB] int32 work items (`ragged_items`)
    item_first: jax.Array,  # [NB] int32
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    qk_chunks: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    out_fill: float | None = 0.0,
) -> jax.Array:
    """Causal attention of every sequence's query chunk over its pages, query i at position
    kv_len - q_len + i -> [T, H, hd] in q.dtype. The items must be built with this call's `block_q`
    (`ragged_block_q` by default). Block sizes, `qk_chunks`,
    warps and stages default to `launch.ragged_launch` for the operand dtypes and head dim. Rows of tokens that
    belong to no sequence are never written: they keep `out_fill` (None leaves them uninitialized;
    tests pass NaN)."""
    num_tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    seqs, max_pages = block_tables.shape
    group = heads // kv_heads
    group_rows = common.next_pow2(group)
    defaults = launch.ragged_launch(q.dtype, k_pages.dtype, head_dim)
    block_q = block_q or ragged_block_q(q.dtype, k_pages.dtype, heads, kv_heads, head_dim)
    pages_per_block = pages_per_block or launch.pages_per_block(defaults.block_tokens, page_size, max_pages)
    qk_chunks = qk_chunks or defaults.qk_chunks
    num_warps = num_warps or defaults.num_warps
    num_stages = num_stages or defaults.num_stages
    common.check_pow2(page_size=page_size, head_dim=head_dim, block_q=block_q, pages_per_block=pages_per_block,
                      qk_chunk_width=head_dim // qk_chunks)
    common.check_min_rows(block_q * group_rows)

    padded_pages = common.cdiv(max_pages, pages_per_block) * pages_per_block
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    inputs = [q, k_pages, v_pages, block_tables,
              *(x.astype(jnp.int32) for x in (query_start, q_lens, kv_lens, item_seq, item_first))]
    aliases = {}
    if out_fill is not None:
        aliases = {len(inputs): 0}
        inputs.append(jnp.full(q.shape, out_fill, q.dtype))
    kernel = functools.partial(
        _ragged_kernel, group=group, group_rows=group_rows, block_q=block_q, pages_per_block=pages_per_block,
        qk_chunks=qk_chunks, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, heads, head_dim), q.dtype),
        grid=(item_seq.shape[0], kv_heads),
        input_output_aliases=aliases,
        interpret=common.resolve_interpret(interpret),
        compiler_params=common.compiler_params(num_warps, num_stages),
        name="jvllm_ragged_paged_attention",
    )(*inputs)
