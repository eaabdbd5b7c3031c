"""Paged decode attention as a Mosaic GPU kernel for Hopper: TMA loads of whole KV pages into shared memory,
wgmma for q.K^T and p.V, an online softmax in registers, K/V blocks double-buffered.

Same interface as `decode_attention.decode_attention` (one query token per sequence, K/V read in place from the
page pool). One program per (sequence, KV head): its G = H / KVH query heads ride as rows of a 64-row wgmma tile
(rows G..63 are zero padding: decode is bound by K/V bytes, not by the tensor cores). A KV block is
`pages_per_block` pages; each page is one TMA copy of a [page, hd] box out of the [N, page, KVH, hd] pool, all of
a block's copies completing on one barrier. Block b + 1's copies are issued before block b is computed.

Needs jax >= 0.11 (`plgpu.kernel`); on CPU it runs in Mosaic GPU's interpret mode (tests). Sliding windows and
logit soft-caps are the Triton kernel's still (`decode_attention.py`)."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

ROWS = 64  # wgmma's M: a warpgroup's tile of query rows
SLOTS = 2  # K/V blocks in shared memory at once


def _kernel(q_ref, k_ref, v_ref, tables_ref, lengths_ref, o_ref, q_smem, k_smem, v_smem, p_smem, o_smem, q_bar, kv_bar, *,
            page_size: int, pages_per_block: int, scale: float):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    seq, head = lax.axis_index("seq"), lax.axis_index("head")
    block_kv = page_size * pages_per_block
    head_dim = q_smem.shape[-1]
    length = lengths_ref[seq]
    num_blocks = lax.div(length + block_kv - 1, block_kv)

    def fetch(block, slot):
        """Issue the TMA copies of block `block`'s K and V pages into `slot`."""
        for j in range(pages_per_block):
            page = tables_ref[seq, block * pages_per_block + j]
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, head], k_smem.at[slot, rows], kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, head], v_smem.at[slot, rows], kv_bar.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_bar)

    @pl.when(num_blocks > 0)
    def _():
        fetch(0, 0)

    plgpu.barrier_wait(q_bar)
    log2e = math.log2(math.e)
    m_i = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def step(block, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(block, SLOTS)

        @pl.when(block + 1 < num_blocks)
        def _():
            fetch(block + 1, lax.rem(block + 1, SLOTS))

        plgpu.barrier_wait(kv_bar.at[slot])

        def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, block_kv), jnp.float32)) * (scale * log2e)
        key = block * block_kv + plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where(key < length, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)

        # p goes through shared memory and into a fresh accumulator: Mosaic GPU's interpret mode takes wgmma's A
        # operand from shared memory only, and has no run_state over a wgmma accumulator
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv_scope(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        pv = pl.run_scoped(pv_scope, plgpu.ACC((ROWS, head_dim), jnp.float32))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
        return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, num_blocks, step, (acc, m_i, l_i))
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)  # a padding row (length 0) attends to nothing: zeros out
    o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[seq, head])
    plgpu.wait_smem_to_gmem(0)


def supports(q_dtype: Any, kv_dtype: Any, heads: int, kv_heads: int, head_dim: int, page_size: int,
             sliding_window: int | None = None, soft_cap: float | None = None) -> bool:
    """Whether this kernel covers a model's decode steps (else the Triton decode kernel takes them)."""
    return (jax.__version_info__ >= (0, 11) and jnp.dtype(q_dtype) == jnp.dtype(kv_dtype)
            and jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 64 == 0
            and heads // kv_heads <= ROWS and page_size % 8 == 0 and sliding_window is None and soft_cap is None)


def mosaic_decode_attention(
    q: jax.Array,  # [S, H, hd] the one query token of each sequence
    k_pages: jax.Array,  # [N, page, KVH, hd]
    v_pages: jax.Array,  # [N, page, KVH, hd]
    block_tables: jax.Array,  # [S, P] int32 page ids (0 when padded)
    lengths: jax.Array,  # [S] int32 keys per sequence including the query's own (0 for padded rows)
    *,
    scale: float,
    pages_per_block: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of each sequence's query over its first `length` cached keys -> [S, H, hd] in q.dtype. 16-bit
    q and pages of one dtype; head_dim a multiple of 64; G = H / KVH <= 64."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import common

    seqs, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    if jax.__version_info__ < (0, 11):
        raise NotImplementedError(f"mosaic decode needs jax >= 0.11 (plgpu.kernel, its interpret mode); "
                                  f"this is jax {jax.__version__}")
    if q.dtype != k_pages.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"mosaic decode: 16-bit q and pages of one dtype, got {q.dtype}, {k_pages.dtype}")
    if head_dim % 64 or group > ROWS or page_size % 8:
        raise NotImplementedError(f"mosaic decode: head_dim {head_dim} (a multiple of 64), group {group} (<= {ROWS}), "
                                  f"page size {page_size} (a multiple of 8)")
    max_pages = block_tables.shape[1]
    pages_per_block = pages_per_block or max(1, min(128 // page_size, max_pages))
    padded_pages = common.cdiv(max_pages, pages_per_block) * pages_per_block
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    # [S, KVH, 64, hd]: each KV head's query heads as the first G rows of a zero-padded wgmma tile
    q_tiles = jnp.pad(q.reshape(seqs, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    block_kv = page_size * pages_per_block
    transforms = _transforms(head_dim, q.dtype)
    kernel = plgpu.kernel(
        functools.partial(_kernel, page_size=page_size, pages_per_block=pages_per_block, scale=scale),
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        scratch_types=[
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((SLOTS, block_kv, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((SLOTS, block_kv, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((ROWS, block_kv), q.dtype, transforms=_transforms(block_kv, q.dtype)),
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=transforms),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=SLOTS),
        ],
        grid=(seqs, kv_heads),
        grid_names=("seq", "head"),
        interpret=plgpu.InterpretGPUParams() if common.resolve_interpret(interpret) else None,
    )
    out = kernel(q_tiles, k_pages, v_pages, block_tables, lengths.astype(jnp.int32))
    return out[:, :, :group].reshape(seqs, heads, head_dim)


def _transforms(row_elements: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for rows of `row_elements` 16-bit values, as wgmma and TMA want them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = min(128, row_elements * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)
