"""Ragged paged attention as a warp-specialized Mosaic GPU kernel for Hopper: two consumer warpgroups share each KV
block that a producer warpgroup loads.

Same interface as `mosaic_ragged.mosaic_ragged_paged_attention`, with work items of BLOCK_Q = 128 queries
(`ragged_items(q_lens, BLOCK_Q, ...)`). One program per (work item, query head), three warpgroups:
- the producer issues the TMA page copies of KV blocks lo..hi-1 (the blocks any of the item's queries sees) into
  SLOTS shared-memory slots, reusing a slot once both consumers have released it;
- consumer w (0 or 1) owns the item's queries 64w..64w+63 as one wgmma tile and folds into its online softmax the
  blocks its own rows see (`mosaic_common.attend_block`); it waits on every block and releases every block, those it
  skips (causally or by the window) included, so that the two stay in step on the slots' barriers.
Against the one-warpgroup kernel each K/V block is read from memory once per 128 queries instead of once per 64, and
one consumer's softmax can run while the other's wgmma does. In the sequence's last block the consumers zero the V
rows past its end, half each, and meet on a barrier before reading the slot. Needs jax >= 0.11; on CPU it runs in
Mosaic GPU's interpret mode (tests)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic_common
from pallas_kernels.mosaic_common import ROWS, SLOTS

CONSUMERS = 2
BLOCK_Q = CONSUMERS * ROWS  # query tokens per work item
MIN_BLOCK_KV = 128  # a block's V rows split into two halves of whole 64-row wgmma tiles for the tail zeroing


def covers(head_dim: int) -> bool:
    """Beyond `mosaic_common.covers`: two 128-token K/V slots, the q and p tiles fit in shared memory up to head 128."""
    return head_dim <= 128


def _kernel(q_ref, k_ref, v_ref, tables_ref, q_lens_ref, kv_lens_ref, item_seq_ref, item_first_ref, o_ref,
            q_smem, k_smem, v_smem, p_smem, q_bar, kv_bar, released_bar, tail_bar, *, group: int,
            pages_per_block: int, scale: float, sliding_window: int | None, soft_cap: float | None,
            p_in_registers: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    item, head, wg = lax.axis_index("item"), lax.axis_index("head"), lax.axis_index("wg")
    seq = item_seq_ref[item]
    first, q_len, kv_len = item_first_ref[item], q_lens_ref[seq], kv_lens_ref[seq]
    cached = kv_len - q_len
    block_kv = k_ref.shape[1] * pages_per_block
    head_dim = q_smem.shape[-1]

    def block_range(row0, rows):
        """KV blocks [lo, hi) that the item's queries row0..row0+rows-1 see, when it has any."""
        last_pos = cached + jnp.minimum(first + row0 + rows, q_len) - 1
        hi = lax.div(last_pos + block_kv, block_kv)
        if sliding_window is None:
            return 0, hi
        return lax.div(jnp.maximum(cached + first + row0 - sliding_window + 1, 0), block_kv), hi

    lo, hi = block_range(0, BLOCK_Q)

    @pl.when(first < q_len)  # unused items carry first = T
    def _():
        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            fetch = functools.partial(
                mosaic_common.fetch_block, tables_ref=tables_ref, seq=seq, kv_head=lax.div(head, group), k_ref=k_ref,
                v_ref=v_ref, k_smem=k_smem, v_smem=v_smem, kv_bar=kv_bar, pages_per_block=pages_per_block)
            for ahead in range(SLOTS):
                @pl.when(lo + ahead < hi)
                def _():
                    fetch(lo + ahead, lax.rem(lo + ahead, SLOTS))

            @pl.loop(lo + SLOTS, hi)
            def _(block):
                slot = lax.rem(block, SLOTS)
                plgpu.barrier_wait(released_bar.at[slot])  # both consumers are done with block - SLOTS
                fetch(block, slot)

            for behind in range(SLOTS):  # observe the last releases too, as every barrier's phases must be
                @pl.when(hi - SLOTS + behind >= lo)
                def _():
                    plgpu.barrier_wait(released_bar.at[lax.rem(hi - SLOTS + behind, SLOTS)])

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[item, wg, :, head], q_smem.at[wg], q_bar.at[wg])
            # this consumer's blocks within the item's [lo, hi); none when its rows are past the chunk's end
            own_lo, own_hi = block_range(wg * ROWS, ROWS)
            own_lo = jnp.clip(own_lo, lo, hi)
            own_hi = jnp.where(first + wg * ROWS < q_len, jnp.clip(own_hi, own_lo, hi), own_lo)
            q_pos = cached + first + wg * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0,
                                                                        layout=plgpu.Layout.WGMMA)

            def visible(key):
                seen = (key <= q_pos) & (key < kv_len)
                return seen if sliding_window is None else seen & (q_pos - key < sliding_window)

            def receive(block):
                """Wait for the block -> its slot; in the sequence's last block, zero this consumer's half of the V
                rows past its end, then meet the other consumer."""
                slot = lax.rem(block, SLOTS)
                plgpu.barrier_wait(kv_bar.at[slot])

                @pl.when(kv_len < (block + 1) * block_kv)
                def _():
                    half = block_kv // CONSUMERS
                    for owner in range(CONSUMERS):
                        @pl.when(wg == owner)
                        def _():
                            mosaic_common.zero_past_end(v_smem.at[slot, pl.ds(owner * half, half)],
                                                        block * block_kv + owner * half, kv_len)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(tail_bar)
                    plgpu.barrier_wait(tail_bar)
                return slot

            def skip(block, carry):
                plgpu.barrier_arrive(released_bar.at[receive(block)])
                return carry

            def attend(block, carry):
                slot = receive(block)
                carry = mosaic_common.attend_block(
                    carry, block, q_smem=q_smem.at[wg], k_slot=k_smem.at[slot], v_slot=v_smem.at[slot],
                    p_smem=p_smem.at[wg], scale=scale, soft_cap=soft_cap, visible=visible,
                    p_in_registers=p_in_registers)
                plgpu.barrier_arrive(released_bar.at[slot])
                return carry

            plgpu.barrier_wait(q_bar.at[wg])
            carry = lax.fori_loop(lo, own_lo, skip, mosaic_common.initial_carry(head_dim))
            carry = lax.fori_loop(own_lo, own_hi, attend, carry)
            acc, _, l_i = lax.fori_loop(own_hi, hi, skip, carry)
            # the q tile is not read again: it takes the output tile
            mosaic_common.store_tile(acc, l_i, q_smem.at[wg], o_ref.at[item, wg, :, head])


def mosaic_ragged_ws_attention(
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
    p_in_registers: bool | None = None,  # None: in registers when compiled (`mosaic_common.attend_block`)
    interpret: Any = None,  # bool, None (interpret off GPU) or plgpu.InterpretGPUParams
) -> jax.Array:
    """Causal attention of every real query token over its sequence's keys -> [T, H, hd] in q.dtype; padding
    tokens' rows are zeros. What it covers: `mosaic_common.covers` and `covers`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mosaic_common.check_covered(q, k_pages)
    num_tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if not covers(head_dim):
        raise NotImplementedError(f"warp-specialized Mosaic GPU ragged attention: head_dim {head_dim} (<= 128)")
    num_items = item_seq.shape[0]
    pages_per_block = pages_per_block or max(
        MIN_BLOCK_KV // page_size, mosaic_common.default_pages_per_block(page_size, block_tables.shape[1]))
    if pages_per_block * page_size < MIN_BLOCK_KV:
        raise ValueError(f"pages_per_block {pages_per_block} x page {page_size}: blocks of >= {MIN_BLOCK_KV} tokens")
    block_tables, pages_per_block = mosaic_common.blocked_tables(block_tables, page_size, pages_per_block)
    token = mosaic_common.item_tokens(query_start, q_lens, item_seq, item_first, BLOCK_Q, num_tokens)  # [NB * 128]
    q_tiles = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[token].reshape(num_items, CONSUMERS, ROWS, heads, head_dim)
    block_kv = page_size * pages_per_block
    rows = mosaic_common.transforms(head_dim, q.dtype)
    interpret = mosaic_common.interpret_params(interpret)
    if p_in_registers and interpret is not None:
        raise NotImplementedError("p_in_registers: Mosaic GPU's interpret mode takes wgmma's A from shared memory")
    kernel = plgpu.kernel(
        functools.partial(_kernel, group=heads // kv_heads, pages_per_block=pages_per_block, scale=scale,
                          sliding_window=sliding_window, soft_cap=soft_cap,
                          p_in_registers=interpret is None if p_in_registers is None else p_in_registers),
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        scratch_types=[
            plgpu.SMEM((CONSUMERS, ROWS, head_dim), q.dtype, transforms=rows),  # q tiles, then output tiles
            plgpu.SMEM((SLOTS, block_kv, head_dim), q.dtype, transforms=rows),
            plgpu.SMEM((SLOTS, block_kv, head_dim), q.dtype, transforms=rows),
            plgpu.SMEM((CONSUMERS, ROWS, block_kv), q.dtype, transforms=mosaic_common.transforms(block_kv, q.dtype)),
            plgpu.Barrier(num_barriers=CONSUMERS),  # each consumer's q tile
            plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=SLOTS),  # a slot's page copies landed
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=SLOTS),  # both consumers released a slot
            plgpu.Barrier(num_arrivals=CONSUMERS),  # both halves of a last block's V rows zeroed
        ],
        grid=(num_items, heads),
        grid_names=("item", "head"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        interpret=interpret,
    )
    tiles = kernel(q_tiles, k_pages, v_pages, block_tables, q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                   item_seq.astype(jnp.int32), item_first.astype(jnp.int32))
    out = jnp.zeros((num_tokens + 1, heads, head_dim), q.dtype).at[token].set(
        tiles.reshape(num_items * BLOCK_Q, heads, head_dim), mode="drop")
    return out[:num_tokens]
