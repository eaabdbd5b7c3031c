"""Paged decode attention as a Mosaic GPU kernel for Hopper: TMA loads of whole KV pages into shared memory,
wgmma for q.K^T and p.V, an online softmax in registers, K/V blocks in 2 or more slots (`mosaic_common`).

Same interface as `decode_attention.decode_attention` (one query token per sequence, K/V read in place from the
page pool). One program per (sequence, KV head): its G = H / KVH query heads ride as rows of a 64-row wgmma tile
(rows G..63 are zero padding: decode is bound by K/V bytes, not by the tensor cores). Sliding windows start the
walk at the window's first block. Needs jax >= 0.11; on CPU it runs in Mosaic GPU's interpret mode (tests)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic_common
from pallas_kernels.mosaic_common import ROWS


def _kernel(q_ref, k_ref, v_ref, tables_ref, lengths_ref, o_ref, q_smem, k_smem, v_smem, q_bar, kv_bar, *p_smem,
            pages_per_block: int, scale: float, sliding_window: int | None, soft_cap: float | None,
            p_in_registers: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    seq, head = lax.axis_index("seq"), lax.axis_index("head")
    length = lengths_ref[seq]  # the query is key length - 1
    block_kv = k_ref.shape[1] * pages_per_block
    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_bar)
    lo = 0 if sliding_window is None else lax.div(jnp.maximum(length - sliding_window, 0), block_kv)

    def visible(key):
        return (key < length) if sliding_window is None else (key < length) & (key >= length - sliding_window)

    plgpu.barrier_wait(q_bar)
    acc, l_i = mosaic_common.attend_blocks(
        lo, lax.div(length + block_kv - 1, block_kv), length, tables_ref=tables_ref, seq=seq, kv_head=head,
        k_ref=k_ref, v_ref=v_ref, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, p_smem=(p_smem or [None])[0],
        kv_bar=kv_bar, pages_per_block=pages_per_block, scale=scale, soft_cap=soft_cap, visible=visible,
        p_in_registers=p_in_registers)
    mosaic_common.store_tile(acc, l_i, q_smem, o_ref.at[seq, head])  # the q tile is not read again


def mosaic_decode_attention(
    q: jax.Array,  # [S, H, hd] the one query token of each sequence
    k_pages: jax.Array,  # [N, page, KVH, hd]
    v_pages: jax.Array,  # [N, page, KVH, hd]
    block_tables: jax.Array,  # [S, P] int32 page ids (0 when padded)
    lengths: jax.Array,  # [S] int32 keys per sequence including the query's own (0 for padded rows)
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    slots: int = mosaic_common.SLOTS,  # KV blocks in shared memory: slots - 1 in flight while one is computed
    p_in_registers: bool | None = None,  # None: in registers when compiled (`mosaic_common.accumulate_pv`)
    interpret: Any = None,  # bool, None (interpret off GPU) or plgpu.InterpretGPUParams
) -> jax.Array:
    """Attention of each sequence's query over its first `length` cached keys (the last `sliding_window` of them
    when set; scores capped by soft_cap * tanh(s / soft_cap)) -> [S, H, hd] in q.dtype (a length-0 row gives
    zeros). What it covers: `mosaic_common.covers`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mosaic_common.check_covered(q, k_pages)
    seqs, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    block_tables, pages_per_block = mosaic_common.blocked_tables(block_tables, page_size, pages_per_block)
    # [S, KVH, 64, hd]: each KV head's query heads as the first G rows of a zero-padded wgmma tile
    q_tiles = jnp.pad(q.reshape(seqs, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    interpret = mosaic_common.interpret_params(interpret)
    p_in_registers = mosaic_common.p_route(p_in_registers, interpret)
    kernel = plgpu.kernel(
        functools.partial(_kernel, pages_per_block=pages_per_block, scale=scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, p_in_registers=p_in_registers),
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        scratch_types=mosaic_common.scratch_types(head_dim, page_size, pages_per_block, q.dtype, slots,
                                                  p_tile=not p_in_registers),
        grid=(seqs, kv_heads),
        grid_names=("seq", "head"),
        interpret=interpret,
    )
    out = kernel(q_tiles, k_pages, v_pages, block_tables, lengths.astype(jnp.int32))
    return out[:, :, :group].reshape(seqs, heads, head_dim)
