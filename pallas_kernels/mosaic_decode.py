"""Paged decode attention as a Mosaic GPU kernel for Hopper: TMA loads of whole KV pages into shared memory,
wgmma for q.K^T and p.V, an online softmax in registers, K/V blocks in 2 or more slots (`mosaic_common`).

Same interface as `decode_attention.decode_attention` (one query token per sequence, K/V read in place from the
page pool). One program per (sequence, KV head): its G = H / KVH query heads ride as rows of a 64-row wgmma tile
(rows G..63 are zero padding: decode is bound by K/V bytes, not by the tensor cores). Sliding windows start the
walk at the window's first block. With `splits` > 1 (flash-decoding's split of the keys), `splits` programs per
(sequence, KV head) each walk an equal share of its blocks and write their normalised partial output and its
base-2 log-sum-exp; the shares are merged outside the kernel. Needs jax >= 0.11; on CPU it runs in Mosaic GPU's
interpret mode (tests)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic_common
from pallas_kernels.mosaic_common import ROWS


def _kernel(q_ref, k_ref, v_ref, tables_ref, lengths_ref, *refs, pages_per_block: int, scale: float,
            sliding_window: int | None, soft_cap: float | None, p_in_registers: bool, splits: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if splits == 1:
        (o_ref, q_smem, k_smem, v_smem, q_bar, kv_bar, *p_smem), lse_ref = refs, None
    else:
        o_ref, lse_ref, q_smem, k_smem, v_smem, q_bar, kv_bar, *p_smem, lse_smem = refs
    seq, head = lax.axis_index("seq"), lax.axis_index("head")
    length = lengths_ref[seq]  # the query is key length - 1
    block_kv = k_ref.shape[1] * pages_per_block
    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_bar)
    lo = 0 if sliding_window is None else lax.div(jnp.maximum(length - sliding_window, 0), block_kv)
    hi = lax.div(length + block_kv - 1, block_kv)
    if splits > 1:  # this program's share of the blocks (none for the last shares of a short sequence)
        split = lax.axis_index("split")
        share = lax.div(hi - lo + splits - 1, splits)
        lo = lo + split * share
        hi = jnp.minimum(hi, lo + share)

    def visible(key):
        return (key < length) if sliding_window is None else (key < length) & (key >= length - sliding_window)

    plgpu.barrier_wait(q_bar)
    acc, m_i, l_i = mosaic_common.attend_blocks(
        lo, hi, length, tables_ref=tables_ref, seq=seq, kv_head=head,
        k_ref=k_ref, v_ref=v_ref, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, p_smem=(p_smem or [None])[0],
        kv_bar=kv_bar, pages_per_block=pages_per_block, scale=scale, soft_cap=soft_cap, visible=visible,
        p_in_registers=p_in_registers)
    if splits == 1:
        mosaic_common.store_tile(acc, l_i, q_smem, o_ref.at[seq, head])  # the q tile is not read again
        return
    lse_smem[...] = m_i + jnp.log(l_i) * mosaic_common.LOG2E  # -inf where the share saw no key
    mosaic_common.store_tile(acc, l_i, q_smem, o_ref.at[seq, head, split])  # commits lse_smem too
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, head, split])
    plgpu.wait_smem_to_gmem(0)


def merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Partial outputs out [..., P, G, hd] (each normalised over its share of the keys) and their base-2
    log-sum-exps lse [..., P, G] f32 -> the attention over all the keys [..., G, hd] f32 (zeros where no share saw a
    key)."""
    top = lse.max(axis=-2, keepdims=True)
    weights = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # [..., P, G]; 0 for a share with no key
    total = weights.sum(axis=-2)  # [..., G]
    merged = (weights[..., None] * out.astype(jnp.float32)).sum(axis=-3)
    return merged / jnp.where(total == 0.0, 1.0, total)[..., None]


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
    splits: int = 1,  # programs per (sequence, KV head), each over an equal share of its KV blocks
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
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    scratch = mosaic_common.scratch_types(head_dim, page_size, pages_per_block, q.dtype, slots,
                                          p_tile=not p_in_registers)
    if splits == 1:
        out_type, grid, names = jax.ShapeDtypeStruct(q_tiles.shape, q.dtype), (seqs, kv_heads), ("seq", "head")
    else:  # [S, KVH, P, 64, hd] partial outputs and [S, KVH, P, 64] their log-sum-exps
        out_type = (jax.ShapeDtypeStruct((seqs, kv_heads, splits, ROWS, head_dim), q.dtype),
                    jax.ShapeDtypeStruct((seqs, kv_heads, splits, ROWS), jnp.float32))
        grid, names = (seqs, kv_heads, splits), ("seq", "head", "split")
        scratch.append(plgpu.SMEM((ROWS,), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, pages_per_block=pages_per_block, scale=scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, p_in_registers=p_in_registers, splits=splits),
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=names,
        interpret=interpret,
    )
    out = kernel(q_tiles, k_pages, v_pages, block_tables, lengths.astype(jnp.int32))
    if splits == 1:
        return out[:, :, :group].reshape(seqs, heads, head_dim)
    partial, lse = out
    merged = merge_splits(partial[:, :, :, :group], lse[:, :, :, :group])  # [S, KVH, G, hd] f32
    return merged.astype(q.dtype).reshape(seqs, heads, head_dim)
