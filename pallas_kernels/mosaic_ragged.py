"""Ragged paged attention (prefill / mixed steps) as a Mosaic GPU kernel for Hopper, on `mosaic_common`'s KV loop.

Same interface as `ragged_attention.ragged_paged_attention`, with the host's work items built at BLOCK_Q = 64
queries (`ragged_items(q_lens, BLOCK_Q, ...)`). One program per (work item, query head): its 64 query tokens of
one sequence are the rows of the wgmma tile (gathered into [items, 64, H, hd] before the kernel), attending
causally (and within the sliding window, with the logit soft-cap) over the pages of the head's KV head, from the
first block a row can see to the block of the item's last query. A work item's tile may run past its sequence's
chunk, so output tiles go to a buffer of the same shape and each real token's row is scattered back into
[T, H, hd] after the kernel. Needs jax >= 0.11; on CPU it runs in Mosaic GPU's interpret mode (tests)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic_common
from pallas_kernels.mosaic_common import ROWS

BLOCK_Q = ROWS  # query tokens per work item


def _kernel(q_ref, k_ref, v_ref, tables_ref, q_lens_ref, kv_lens_ref, item_seq_ref, item_first_ref, o_ref, q_smem,
            k_smem, v_smem, q_bar, kv_bar, *p_smem, group: int, pages_per_block: int, scale: float,
            sliding_window: int | None, soft_cap: float | None, p_in_registers: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    item, head = lax.axis_index("item"), lax.axis_index("head")
    seq = item_seq_ref[item]
    first, q_len = item_first_ref[item], q_lens_ref[seq]

    @pl.when(first < q_len)  # unused items carry first = T
    def _():
        block_kv = k_ref.shape[1] * pages_per_block
        kv_len = kv_lens_ref[seq]
        cached = kv_len - q_len
        plgpu.copy_gmem_to_smem(q_ref.at[item, :, head], q_smem, q_bar)
        last_pos = cached + jnp.minimum(first + BLOCK_Q, q_len) - 1
        hi = lax.div(last_pos + block_kv, block_kv)
        lo = 0 if sliding_window is None else lax.div(jnp.maximum(cached + first - sliding_window + 1, 0), block_kv)
        q_pos = cached + first + plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 0,
                                                        layout=plgpu.Layout.WGMMA)

        def visible(key):
            seen = (key <= q_pos) & (key < kv_len)
            return seen if sliding_window is None else seen & (q_pos - key < sliding_window)

        plgpu.barrier_wait(q_bar)
        acc, _, l_i = mosaic_common.attend_blocks(
            lo, hi, kv_len, tables_ref=tables_ref, seq=seq, kv_head=lax.div(head, group), k_ref=k_ref, v_ref=v_ref,
            q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, p_smem=(p_smem or [None])[0], kv_bar=kv_bar,
            pages_per_block=pages_per_block, scale=scale, soft_cap=soft_cap, visible=visible,
            p_in_registers=p_in_registers)
        mosaic_common.store_tile(acc, l_i, q_smem, o_ref.at[item, :, head])  # the q tile is not read again


def mosaic_ragged_paged_attention(
    q: jax.Array,  # [T, H, hd] flat query tokens, sequences back to back (padding tokens at the end)
    k_pages: jax.Array,  # [N, page, KVH, hd] already holding every query token's own K/V
    v_pages: jax.Array,  # [N, page, KVH, hd]
    query_start: jax.Array,  # [S] int32 flat index of each sequence's first token
    q_lens: jax.Array,  # [S] int32 query tokens per sequence (0 for padded rows)
    kv_lens: jax.Array,  # [S] int32 keys per sequence, its query tokens included
    block_tables: jax.Array,  # [S, P] int32 page ids (0 when padded)
    item_seq: jax.Array,  # [NB] int32 work items of BLOCK_Q queries (`ragged_items(..., BLOCK_Q, ...)`)
    item_first: jax.Array,  # [NB] int32
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    p_in_registers: bool | None = None,  # None: in registers when compiled (`mosaic_common.accumulate_pv`)
    interpret: Any = None,  # bool, None (interpret off GPU) or plgpu.InterpretGPUParams
) -> jax.Array:
    """Causal attention of every real query token over its sequence's keys -> [T, H, hd] in q.dtype; padding
    tokens' rows are zeros. What it covers: `mosaic_common.covers`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mosaic_common.check_covered(q, k_pages)
    num_tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    num_items = item_seq.shape[0]
    block_tables, pages_per_block = mosaic_common.blocked_tables(block_tables, page_size, pages_per_block)
    # each work item's rows, token by token: its sequence's tokens, then the zero row T past the chunk's end (a
    # tile gathered outside the kernel: in the kernel a TMA box at a data-dependent row is beyond layout inference)
    token = mosaic_common.item_tokens(query_start, q_lens, item_seq, item_first, BLOCK_Q, num_tokens)  # [NB * 64]
    q_tiles = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[token].reshape(num_items, BLOCK_Q, heads, head_dim)
    interpret = mosaic_common.interpret_params(interpret)
    p_in_registers = mosaic_common.p_route(p_in_registers, interpret)
    kernel = plgpu.kernel(
        functools.partial(_kernel, group=heads // kv_heads, pages_per_block=pages_per_block, scale=scale,
                          sliding_window=sliding_window, soft_cap=soft_cap, p_in_registers=p_in_registers),
        out_type=jax.ShapeDtypeStruct((num_items, BLOCK_Q, heads, head_dim), q.dtype),
        scratch_types=mosaic_common.scratch_types(head_dim, page_size, pages_per_block, q.dtype,
                                                  p_tile=not p_in_registers),
        grid=(num_items, heads),
        grid_names=("item", "head"),
        interpret=interpret,
    )
    tiles = kernel(q_tiles, k_pages, v_pages, block_tables, q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                   item_seq.astype(jnp.int32), item_first.astype(jnp.int32))
    out = jnp.zeros((num_tokens + 1, heads, head_dim), q.dtype).at[token].set(
        tiles.reshape(num_items * BLOCK_Q, heads, head_dim), mode="drop")
    return out[:num_tokens]
