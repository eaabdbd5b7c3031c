"""Ragged paged attention as a warp-specialized Mosaic GPU kernel for Hopper: two consumer warpgroups share each KV
block that a producer warpgroup loads.

Same interface as `mosaic_ragged.mosaic_ragged_paged_attention`, with work items of BLOCK_Q = 128 queries
(`ragged_items(q_lens, BLOCK_Q, ...)`). One program per (work item, query head), three warpgroups:
- the producer issues the TMA page copies of KV blocks lo..hi-1 (the blocks any of the item's queries sees) into
  SLOTS shared-memory slots, K and V on barriers of their own; a slot's K is reloaded once both consumers have
  scored it, its V once both have multiplied it;
- consumer w (0 or 1) owns the item's queries 64w..64w+63 as one wgmma tile and folds into its online softmax the
  blocks its own rows see; it waits on and releases every block, those it skips (causally or by the window)
  included, so that the two stay in step on the slots' barriers. Blocks wholly in its rows' past (and window) are
  scored without a mask; only the diagonal, the window's edge and the sequence's end are masked.
- with `ping_pong` the consumers take turns on a barrier (as in jax's `attention_mgpu`): one's softmax runs while
  the other's two wgmmas do.
Against the one-warpgroup kernel each K/V block is read from memory once per 128 queries instead of once per 64. In
the sequence's last block the consumers zero the V rows past its end, half each, and meet on a barrier before
either multiplies the slot (between their turns' arrive and wait, so that the turns cannot hold a consumer back
from the meeting). Compiled with approximate exp2 and tanh (one instruction each). Needs jax >= 0.11; on CPU it
runs in Mosaic GPU's interpret mode (tests)."""
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
            q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_released, v_released, tail_bar, turn_bar, *p_smem,
            group: int, pages_per_block: int, scale: float, sliding_window: int | None, soft_cap: float | None,
            p_in_registers: bool, ping_pong: bool):
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
            pools = ((k_ref, k_smem, k_bar, k_released), (v_ref, v_smem, v_bar, v_released))
            kv_head = lax.div(head, group)

            def fetch(block, pages, pages_ref, smem, bar):
                slot = lax.rem(block, SLOTS)
                mosaic_common.fetch_pages(pages, slot, kv_head=kv_head, pages_ref=pages_ref, smem=smem,
                                          bar=bar.at[slot])

            for ahead in range(SLOTS):
                @pl.when(lo + ahead < hi)
                def _():
                    pages = mosaic_common.block_pages(tables_ref, seq, lo + ahead, pages_per_block)
                    for pages_ref, smem, bar, _ in pools:
                        fetch(lo + ahead, pages, pages_ref, smem, bar)

            @pl.loop(lo + SLOTS, hi)
            def _(block):
                pages = mosaic_common.block_pages(tables_ref, seq, block, pages_per_block)  # read while waiting
                for pages_ref, smem, bar, released in pools:  # K waits only for the consumers' q.K^T of block - SLOTS
                    plgpu.barrier_wait(released.at[lax.rem(block, SLOTS)])
                    fetch(block, pages, pages_ref, smem, bar)

            for behind in range(SLOTS):  # observe the last releases too, as every barrier's phases must be
                @pl.when(hi - SLOTS + behind >= lo)
                def _():
                    for *_, released in pools:
                        plgpu.barrier_wait(released.at[lax.rem(hi - SLOTS + behind, SLOTS)])

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[item, wg, :, head], q_smem.at[wg], q_bar.at[wg])
            row0 = first + wg * ROWS  # this consumer's first query within the sequence's chunk
            # its blocks within the item's [lo, hi); none when its rows are past the chunk's end
            own_lo, own_hi = block_range(wg * ROWS, ROWS)
            own_lo = jnp.clip(own_lo, lo, hi)
            own_hi = jnp.where(row0 < q_len, jnp.clip(own_hi, own_lo, hi), own_lo)
            # [whole_lo, whole_hi): blocks whose every key each of its real rows sees, scored without a mask
            whole_hi = lax.div(cached + row0 + 1, block_kv)
            whole_lo = own_lo
            if sliding_window is not None:
                last_pos = cached + jnp.minimum(row0 + ROWS, q_len) - 1
                whole_lo = lax.div(jnp.maximum(last_pos - sliding_window + 1, 0) + block_kv - 1, block_kv)
            whole_lo = jnp.clip(whole_lo, own_lo, own_hi)
            whole_hi = jnp.clip(whole_hi, whole_lo, own_hi)

            def take_turn():
                """With ping_pong, the two consumers alternate: one's softmax runs while the other's wgmma does."""
                if ping_pong:
                    plgpu.barrier_arrive(turn_bar)
                    plgpu.barrier_wait(turn_bar)

            def visible(block):
                """[64, block] bool: the keys of `block` each row sees (its causal past within the sequence and the
                window)."""
                rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
                behind = cols - rows  # key - query position, less the scalar offset below
                offset = cached + row0 - block * block_kv
                seen = (behind <= offset) & (cols < kv_len - block * block_kv)
                return seen if sliding_window is None else seen & (behind > offset - sliding_window)

            def zero_tail(block, slot):
                """In the sequence's last block, zero this consumer's half of the V rows past its end, then meet the
                other consumer."""
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

            def step(block, carry, *, attend: bool, masked: bool = True):
                """Block `block` folded into the carry (`attend`), or only waited on and released (the other
                consumer's block); both consumers take the same barrier steps either way."""
                slot = lax.rem(block, SLOTS)
                plgpu.barrier_wait(k_bar.at[slot])
                if attend:
                    s = mosaic_common.block_scores(q_smem.at[wg], k_smem.at[slot], after_issue=take_turn)
                else:
                    take_turn()
                plgpu.barrier_arrive(k_released.at[slot])
                if attend:
                    acc, m_i, l_i, p = mosaic_common.fold_scores(carry, s, scale=scale, soft_cap=soft_cap,
                                                                  visible=visible(block) if masked else None)
                    p16 = p.astype(v_smem.dtype)
                    if p_in_registers:  # the softmax ends here, before the turn passes (as in jax's attention_mgpu)
                        acc, m_i, l_i, p16 = lax.optimization_barrier((acc, m_i, l_i, p16))
                if ping_pong:
                    plgpu.barrier_arrive(turn_bar)
                plgpu.barrier_wait(v_bar.at[slot])
                zero_tail(block, slot)
                if ping_pong:
                    plgpu.barrier_wait(turn_bar)
                if attend:
                    acc = mosaic_common.accumulate_pv(acc, p16, v_smem.at[slot],
                                                      p_smem[0].at[wg] if p_smem else None, p_in_registers)
                    carry = acc, m_i, l_i
                plgpu.barrier_arrive(v_released.at[slot])
                return carry

            skip = functools.partial(step, attend=False)
            attend_masked = functools.partial(step, attend=True)
            attend_whole = functools.partial(step, attend=True, masked=False)
            carry = mosaic_common.initial_carry(head_dim)
            plgpu.barrier_wait(q_bar.at[wg])
            if ping_pong:
                pl.when(wg == 1)(take_turn)  # consumer 0 takes the first turn
            carry = lax.fori_loop(lo, own_lo, skip, carry)
            if sliding_window is not None:  # the window's leading edge
                carry = lax.fori_loop(own_lo, whole_lo, attend_masked, carry)
            carry = lax.fori_loop(whole_lo, whole_hi, attend_whole, carry)
            carry = lax.fori_loop(whole_hi, own_hi, attend_masked, carry)  # the causal diagonal, the sequence's end
            acc, _, l_i = lax.fori_loop(own_hi, hi, skip, carry)
            if ping_pong:
                pl.when(wg == 0)(take_turn)  # the turns even out: each consumer arrived 2 (hi - lo) + 1 times
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
    p_in_registers: bool | None = None,  # None: in registers when compiled (`mosaic_common.accumulate_pv`)
    ping_pong: bool = True,  # the consumers take turns at the tensor cores
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
    p_in_registers = mosaic_common.p_route(p_in_registers, interpret)
    kernel = plgpu.kernel(
        functools.partial(_kernel, group=heads // kv_heads, pages_per_block=pages_per_block, scale=scale,
                          sliding_window=sliding_window, soft_cap=soft_cap,
                          p_in_registers=p_in_registers, ping_pong=ping_pong),
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        scratch_types=[
            plgpu.SMEM((CONSUMERS, ROWS, head_dim), q.dtype, transforms=rows),  # q tiles, then output tiles
            plgpu.SMEM((SLOTS, block_kv, head_dim), q.dtype, transforms=rows),
            plgpu.SMEM((SLOTS, block_kv, head_dim), q.dtype, transforms=rows),
            plgpu.Barrier(num_barriers=CONSUMERS),  # each consumer's q tile
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=SLOTS),  # a slot's K pages landed
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=SLOTS),  # its V pages landed
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=SLOTS),  # both consumers are done with a slot's K
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=SLOTS),  # and with its V
            plgpu.Barrier(num_arrivals=CONSUMERS),  # both halves of a last block's V rows zeroed
            plgpu.Barrier(num_arrivals=CONSUMERS),  # the consumers' turns at the tensor cores
            # the p tiles on their way to wgmma through shared memory (`mosaic_common.accumulate_pv`)
            *([] if p_in_registers else [plgpu.SMEM((CONSUMERS, ROWS, block_kv), q.dtype,
                                                     transforms=mosaic_common.transforms(block_kv, q.dtype))]),
        ],
        grid=(num_items, heads),
        grid_names=("item", "head"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),  # exp2 and tanh as single approximate instructions
        interpret=interpret,
    )
    tiles = kernel(q_tiles, k_pages, v_pages, block_tables, q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                   item_seq.astype(jnp.int32), item_first.astype(jnp.int32))
    out = jnp.zeros((num_tokens + 1, heads, head_dim), q.dtype).at[token].set(
        tiles.reshape(num_items * BLOCK_Q, heads, head_dim), mode="drop")
    return out[:num_tokens]
