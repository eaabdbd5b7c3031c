"""Pieces the Mosaic GPU attention kernels share: shared-memory layouts, the TMA page fetch of a KV block, and the
loop over KV blocks with an online softmax (wgmma for q.K^T and p.V), in 2 or more shared-memory slots.

A kernel program holds a 64-row query tile (one warpgroup's wgmma M) in shared memory and walks KV blocks of
`pages_per_block` pages of one KV head: each page is one TMA copy of a [page, hd] box out of the [N, page, KVH, hd]
pool, all of a block's K and V copies arriving on one barrier; blocks b + 1 .. b + slots - 1 have their copies
issued before block b is computed. Scores are kept in base 2 with the softmax scale folded in."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

ROWS = 64  # wgmma's M: a warpgroup's tile of query rows
SLOTS = 2  # KV blocks in shared memory at once, by default
LOG2E = math.log2(math.e)


def mosaic_gpu_available() -> bool:
    """plgpu.kernel and Mosaic GPU's interpret mode exist from jax 0.11."""
    return jax.__version_info__ >= (0, 11)


def covers(q_dtype: Any, kv_dtype: Any, heads: int, kv_heads: int, head_dim: int, page_size: int) -> bool:
    """Whether the Mosaic GPU kernels take these operands: 16-bit q and pages of one dtype, head_dim a multiple of
    64, at most 64 query heads per KV head, pages of a multiple of 8 tokens."""
    return (mosaic_gpu_available() and jnp.dtype(q_dtype) == jnp.dtype(kv_dtype)
            and jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 64 == 0
            and heads // kv_heads <= ROWS and page_size % 8 == 0)


def check_covered(q: jax.Array, k_pages: jax.Array) -> None:
    """Raise NotImplementedError naming what the kernels do not cover."""
    if not mosaic_gpu_available():
        raise NotImplementedError(f"the Mosaic GPU kernels need jax >= 0.11 (plgpu.kernel, its interpret mode); "
                                  f"this is jax {jax.__version__}")
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if q.dtype != k_pages.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"Mosaic GPU attention: 16-bit q and pages of one dtype, got {q.dtype}, "
                                  f"{k_pages.dtype}")
    if not covers(q.dtype, k_pages.dtype, heads, kv_heads, head_dim, page_size):
        raise NotImplementedError(f"Mosaic GPU attention: head_dim {head_dim} (a multiple of 64), group "
                                  f"{heads // kv_heads} (<= {ROWS}), page size {page_size} (a multiple of 8)")


def transforms(row_elements: int, dtype: Any) -> tuple:
    """Shared-memory tiling and swizzle for rows of `row_elements` 16-bit values, as wgmma and TMA want them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = min(128, row_elements * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def scratch_types(head_dim: int, page_size: int, pages_per_block: int, dtype: Any, slots: int = SLOTS,
                  p_tile: bool = True) -> list:
    """Shared memory of a program: the q tile (the output tile once the blocks are done), `slots` K and V slots,
    q's barrier, the slots' barriers (one arrival per page copy), and with `p_tile` the [64, block] tile p goes
    through to wgmma (`accumulate_pv`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    block_kv = page_size * pages_per_block
    rows = transforms(head_dim, dtype)
    return [plgpu.SMEM((ROWS, head_dim), dtype, transforms=rows),
            plgpu.SMEM((slots, block_kv, head_dim), dtype, transforms=rows),
            plgpu.SMEM((slots, block_kv, head_dim), dtype, transforms=rows),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=slots),
            *([plgpu.SMEM((ROWS, block_kv), dtype, transforms=transforms(block_kv, dtype))] if p_tile else [])]


def p_route(p_in_registers: bool | None, interpret: Any) -> bool:
    """Whether p reaches wgmma from registers (`accumulate_pv`): by default when compiled; never interpreted."""
    if p_in_registers and interpret is not None:
        raise NotImplementedError("p_in_registers: Mosaic GPU's interpret mode takes wgmma's A from shared memory")
    return interpret is None if p_in_registers is None else p_in_registers


def item_tokens(query_start: jax.Array, q_lens: jax.Array, item_seq: jax.Array, item_first: jax.Array, block_q: int,
                num_tokens: int) -> jax.Array:
    """-> [NB * block_q] int32: the flat token of each work item's rows, row by row, or num_tokens (a zero row
    appended to q) for rows past the end of the item's chunk."""
    offsets = item_first[:, None] + jnp.arange(block_q)[None, :]  # [NB, block_q]
    real = offsets < q_lens[item_seq][:, None]
    return jnp.where(real, query_start[item_seq][:, None] + offsets, num_tokens).reshape(-1)


def default_pages_per_block(page_size: int, max_pages: int) -> int:
    """128-token KV blocks (wgmma's N for q.K^T); 64 when the table is narrower. A power of two, so that a block's
    rows of 16-bit values fill whole 32/64/128-byte swizzle rows."""
    from pallas_kernels import common

    return max(1, 64 // page_size, min(128 // page_size, common.next_pow2(max_pages)))


def blocked_tables(block_tables: jax.Array, page_size: int, pages_per_block: int | None) -> tuple[jax.Array, int]:
    """-> (block tables [S, P'] int32 padded with page 0 to whole KV blocks, pages per block: the given one,
    checked, or the default)."""
    from pallas_kernels import common

    max_pages = block_tables.shape[1]
    pages_per_block = pages_per_block or default_pages_per_block(page_size, max_pages)
    if pages_per_block & (pages_per_block - 1) or pages_per_block * page_size < ROWS:
        raise ValueError(f"pages_per_block {pages_per_block} x page {page_size}: a power of two of pages holding "
                         f">= {ROWS} tokens")
    padded_pages = common.cdiv(max_pages, pages_per_block) * pages_per_block
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages))), pages_per_block


def block_pages(tables_ref, seq: jax.Array, block: jax.Array, pages_per_block: int) -> list[jax.Array]:
    """The page ids of KV block `block` of sequence `seq`, read together before any copy is issued, so that their
    reads' latencies overlap (a TMA issue writes memory: the compiler cannot be counted on to hoist a later read
    above it)."""
    return [tables_ref[seq, block * pages_per_block + j] for j in range(pages_per_block)]


def fetch_pages(pages: list[jax.Array], slot: jax.Array, *, kv_head: jax.Array, pages_ref, smem, bar) -> None:
    """Start the TMA copies of one KV block's `pages` (ids from `block_pages`) out of one pool (`pages_ref`: K or V,
    its pages of `kv_head`) into shared memory slot `slot` of `smem`; each copy arrives on `bar`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    page_size = pages_ref.shape[1]
    for j, page in enumerate(pages):
        plgpu.copy_gmem_to_smem(pages_ref.at[page, :, kv_head], smem.at[slot, pl.ds(j * page_size, page_size)], bar)


def fetch_block(block: jax.Array, slot: jax.Array, *, tables_ref, seq: jax.Array, kv_head: jax.Array, k_ref, v_ref,
                k_smem, v_smem, kv_bar, pages_per_block: int) -> None:
    """Start the TMA copies of KV block `block` of sequence `seq` (its pages of `kv_head`, K and V) into shared
    memory slot `slot`; all 2 x pages_per_block copies arrive on kv_bar[slot]."""
    pages = block_pages(tables_ref, seq, block, pages_per_block)
    for pages_ref, smem in ((k_ref, k_smem), (v_ref, v_smem)):
        fetch_pages(pages, slot, kv_head=kv_head, pages_ref=pages_ref, smem=smem, bar=kv_bar.at[slot])


def attend_blocks(lo: jax.Array, hi: jax.Array, kv_len: jax.Array, *, tables_ref, seq: jax.Array, kv_head: jax.Array,
                  k_ref, v_ref, q_smem, k_smem, v_smem, p_smem, kv_bar, pages_per_block: int, scale: float,
                  soft_cap: float | None, visible: Callable[[jax.Array], jax.Array],
                  p_in_registers: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of the query tile in `q_smem` over KV blocks lo..hi-1 of sequence `seq`, whose keys end at
    `kv_len` -> (acc [64, hd] f32 unnormalised, m [64] f32 row maxima in base 2 with the scale folded in, l [64]
    f32 row sums; with no block, zeros, -inf and zeros), with the copies of the next slots - 1 blocks
    in flight while a block is computed (the slots: k_smem's first dimension). `visible(key [64, block] int32) ->
    bool [64, block]` masks scores; keys at or past kv_len must be hidden by it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    page_size = k_ref.shape[1]
    block_kv = page_size * pages_per_block
    head_dim = q_smem.shape[-1]

    def fetch(block, slot):
        fetch_block(block, slot, tables_ref=tables_ref, seq=seq, kv_head=kv_head, k_ref=k_ref, v_ref=v_ref,
                    k_smem=k_smem, v_smem=v_smem, kv_bar=kv_bar, pages_per_block=pages_per_block)

    slots = k_smem.shape[0]
    for ahead in range(slots - 1):
        @pl.when(lo + ahead < hi)
        def _():
            fetch(lo + ahead, lax.rem(lo + ahead, slots))

    def step(block, carry):
        slot = lax.rem(block, slots)

        @pl.when(block + slots - 1 < hi)
        def _():  # into the slot the previous block was read from (its wgmma has completed)
            fetch(block + slots - 1, lax.rem(block + slots - 1, slots))

        plgpu.barrier_wait(kv_bar.at[slot])

        @pl.when(kv_len < (block + 1) * block_kv)
        def _():
            zero_past_end(v_smem.at[slot], block * block_kv, kv_len)
            plgpu.commit_smem()

        return attend_block(carry, block, q_smem=q_smem, k_slot=k_smem.at[slot], v_slot=v_smem.at[slot],
                            p_smem=p_smem, scale=scale, soft_cap=soft_cap, visible=visible,
                            p_in_registers=p_in_registers)

    return lax.fori_loop(lo, hi, step, initial_carry(head_dim))


def zero_past_end(v_rows, first_key: jax.Array, kv_len: jax.Array) -> None:
    """Zero the rows of `v_rows` [rows, hd] (shared memory; keys first_key.. on) at or past the sequence's end
    `kv_len`: those slots may hold anything, NaN included, and p.V sums 0 x V over them. The caller fences."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    key = first_key + plgpu.broadcasted_iota(jnp.int32, v_rows.shape, 0, layout=plgpu.Layout.WGMMA)
    v_rows[...] = jnp.where(key < kv_len, v_rows[...], 0)


def initial_carry(head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online softmax's start -> (acc [64, hd] f32 zeros, m [64] -inf, l [64] zeros) in wgmma's layouts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)))


def attend_block(carry: tuple[jax.Array, jax.Array, jax.Array], block: jax.Array, *, q_smem, k_slot, v_slot, p_smem,
                 scale: float, soft_cap: float | None, visible: Callable[[jax.Array], jax.Array],
                 p_in_registers: bool = False):
    """One KV block (`k_slot`, `v_slot` [block, hd] in shared memory, loaded and fenced) folded into the online
    softmax of the query tile in `q_smem` [64, hd]: carry (acc, m, l) -> (acc, m, l). `visible(key [64, block]
    int32) -> bool [64, block]` masks scores; `p_in_registers`: see `accumulate_pv`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    block_kv = k_slot.shape[0]
    s = block_scores(q_smem, k_slot)
    key = block * block_kv + plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
    acc, m_new, l_i, p = fold_scores(carry, s, scale=scale, soft_cap=soft_cap, visible=visible(key))
    return accumulate_pv(acc, p.astype(v_slot.dtype), v_slot, p_smem, p_in_registers), m_new, l_i


def block_scores(q_smem, k_slot, after_issue: Callable[[], None] | None = None) -> jax.Array:
    """q.K^T of the query tile `q_smem` [64, hd] and a loaded K slot [block, hd] -> raw scores [64, block] f32 in
    wgmma's layout; `after_issue` runs between issuing the wgmma and waiting for its result."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_slot.transpose((1, 0)))
        if after_issue is not None:
            after_issue()
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((ROWS, k_slot.shape[0]), jnp.float32))


def fold_scores(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, *, scale: float,
                soft_cap: float | None, visible: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The online softmax's step over raw scores s [64, block] f32 (hidden where `visible` [64, block] bool is
    False; None: every score counts): carry (acc, m, l) -> (acc rescaled to the new maximum, m, l, p [64, block]
    f32). m is kept in base 2 with the softmax scale folded in, so each p is one multiply-add and one exp2."""
    acc, m_i, l_i = carry
    if soft_cap is None:
        x, to_base2 = s, scale * LOG2E
    else:  # soft_cap * tanh(s * scale / soft_cap)
        x, to_base2 = jnp.tanh(s * (scale / soft_cap)), soft_cap * LOG2E
    if visible is not None:
        x = jnp.where(visible, x, -jnp.inf)
    m_new = jnp.maximum(m_i, x.max(axis=1) * to_base2)
    # a row that has seen no key yet (m still -inf; only where scores are hidden) gets p = 0 and alpha = 0 from a
    # finite stand-in maximum
    m_finite = m_new if visible is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_finite)
    p = jnp.exp2(x * to_base2 - lax.broadcast_in_dim(m_finite, x.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), m_new, l_i, p


def accumulate_pv(acc: jax.Array, p16: jax.Array, v_slot, p_smem, p_in_registers: bool) -> jax.Array:
    """acc [64, hd] f32 + p16 [64, block] (V's dtype) . v_slot [block, hd] (loaded, fenced). `p_in_registers` hands
    p to wgmma from registers and accumulates into acc in place (compiled only: Mosaic GPU's interpret mode has
    neither); otherwise p goes through `p_smem` [64, block] into a fresh accumulator added to acc."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if p_in_registers:
        def accumulate(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_slot)

        return pl.run_state(accumulate)(plgpu.ACC.init(acc))
    # Mosaic GPU's interpret mode takes wgmma's A operand from shared memory only, and has no run_state over a
    # wgmma accumulator
    p_smem[...] = p16
    plgpu.commit_smem()

    def pv_scope(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_slot)
        return acc_ref[...]

    return acc + pl.run_scoped(pv_scope, plgpu.ACC((ROWS, v_slot.shape[1]), jnp.float32))


def store_tile(acc: jax.Array, l_i: jax.Array, o_smem, o_gmem) -> None:
    """acc / l (rows that saw no key: zeros) through shared memory into the GMEM ref `o_gmem` [64, hd]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)


def interpret_params(interpret: Any) -> Any:
    """Mosaic GPU's interpret mode (shared memory, barriers and TMA simulated on CPU) where Pallas interprets;
    `interpret` is True, False, None (the default for this backend) or a `plgpu.InterpretGPUParams` (tests turn
    its race detector on)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import common

    if interpret is not None and not isinstance(interpret, bool):
        return interpret
    return plgpu.InterpretGPUParams() if common.resolve_interpret(interpret) else None
