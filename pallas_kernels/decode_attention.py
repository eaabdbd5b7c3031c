"""Paged decode attention (flash-decoding): one query token per sequence, split over page blocks, then combined."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common, launch

# (seq, kv_head, split) programs to aim for: an H100 holds 132 SMs x 4 decode CTAs (head dim <= 128) = 528 at
# once, so 512 programs run as one wave (docs/pallas.md, roofline); more splits would add partial-output bytes
_TARGET_PROGRAMS = 512


def _decode_kernel(
    q_ref,  # [S, H, hd]
    k_pages_ref,  # [N, page, KVH, hd]
    v_pages_ref,  # [N, page, KVH, hd]
    block_tables_ref,  # [S, P_pad]
    lengths_ref,  # [S]
    *refs,  # optional aliased initial outputs, then o [splits, S, KVH, R, hd], m / l [splits, S, KVH, R]
    group: int,
    rows: int,
    pages_per_block: int,
    blocks_per_split: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    o_ref, m_ref, l_ref = refs[-3:]
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[2]
    block_k = pages_per_block * k_pages_ref.shape[1]
    length = lengths_ref[seq]
    q_pos = length - 1

    # the query heads sharing this KV head, padded to `rows` (>= 16 for tl.dot); the pad rows read as zeros
    head_rows = pl.ds(kv_head * group, rows)
    if rows == group:
        q = q_ref[seq, head_rows, :]
    else:
        row_mask = jnp.broadcast_to((jnp.arange(rows) < group)[:, None], (rows, head_dim))
        q = pltriton.load(q_ref.at[seq, head_rows, :], mask=row_mask, other=0)

    first = split * blocks_per_split
    hi = jnp.minimum(first + blocks_per_split, common.cdiv(length, block_k))
    lo = first
    if sliding_window is not None:
        lo = jnp.maximum(first, jax.lax.div(jnp.maximum(q_pos - sliding_window + 1, 0), block_k))

    def body(block, carry):
        k_pos = block * block_k + jnp.arange(block_k)  # [BK]
        valid = k_pos < length
        if sliding_window is not None:
            valid &= q_pos - k_pos < sliding_window
        k = common.load_kv_block(k_pages_ref, block_tables_ref, seq, kv_head, block, pages_per_block, None)
        v = common.load_kv_block(v_pages_ref, block_tables_ref, seq, kv_head, block, pages_per_block, valid)
        visible = jnp.broadcast_to(valid[None, :], (rows, block_k))
        return common.online_softmax_step(carry, (q,), (k,), v, visible, scale, soft_cap)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), common.MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[split, seq, kv_head, :, :] = o
    m_ref[split, seq, kv_head, :] = m
    l_ref[split, seq, kv_head, :] = l


def default_splits(pages_per_block: int, max_pages: int, num_seqs: int, kv_heads: int) -> int:
    """Split the pages until the grid has enough programs for the GPU, but never into splits with no block."""
    num_blocks = common.cdiv(max_pages, pages_per_block)
    wanted = common.cdiv(_TARGET_PROGRAMS, num_seqs * kv_heads)
    return max(1, min(common.next_pow2(wanted), num_blocks))


def combine_splits(
    o: jax.Array,  # [splits, S, KVH, R, hd] f32 unnormalized partial outputs
    m: jax.Array,  # [splits, S, KVH, R] f32 partial row maxima
    l: jax.Array,  # [splits, S, KVH, R] f32 partial softmax denominators
) -> jax.Array:
    """Merge the per-split partial softmaxes -> [S, KVH, R, hd] f32; rows that saw no key give zeros."""
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_max[None])  # [splits, S, KVH, R]
    denom = jnp.sum(l * weight, axis=0)
    numer = jnp.sum(o * weight[..., None], axis=0)
    return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


def decode_attention(
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
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    out_fill: float | None = None,
) -> jax.Array:
    """Attention of each sequence's query (at position length - 1) over its first `length` cached keys
    -> [S, H, hd] in q.dtype. Block size, warps and stages default to `launch.decode_launch` for the
    operand dtypes and head dim. `out_fill` pre-fills the kernel's partial outputs (tests pass NaN so an
    element the kernel forgot to write shows up)."""
    seqs, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    rows = max(16, common.next_pow2(group))
    max_pages = block_tables.shape[1]
    defaults = launch.decode_launch(q.dtype, k_pages.dtype, head_dim)
    pages_per_block = pages_per_block or launch.pages_per_block(defaults.block_tokens, page_size, max_pages)
    num_splits = num_splits or default_splits(pages_per_block, max_pages, seqs, kv_heads)
    num_warps = num_warps or defaults.num_warps
    num_stages = num_stages or defaults.num_stages
    common.check_pow2(page_size=page_size, head_dim=head_dim, pages_per_block=pages_per_block, rows=rows)

    # pad the block table so every split owns the same whole number of blocks; padded pages are masked
    blocks_per_split = common.cdiv(common.cdiv(max_pages, pages_per_block), num_splits)
    padded_pages = num_splits * blocks_per_split * pages_per_block
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))

    part_shape = (num_splits, seqs, kv_heads, rows)
    out_shape = [jax.ShapeDtypeStruct((*part_shape, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct(part_shape, jnp.float32), jax.ShapeDtypeStruct(part_shape, jnp.float32)]
    inputs = [q, k_pages, v_pages, block_tables, lengths.astype(jnp.int32)]
    aliases = {}
    if out_fill is not None:
        aliases = {len(inputs) + i: i for i in range(3)}
        inputs += [jnp.full(s.shape, out_fill, s.dtype) for s in out_shape]
    kernel = functools.partial(
        _decode_kernel, group=group, rows=rows, pages_per_block=pages_per_block,
        blocks_per_split=blocks_per_split, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(seqs, kv_heads, num_splits),
        input_output_aliases=aliases,
        interpret=common.resolve_interpret(interpret),
        compiler_params=common.compiler_params(num_warps, num_stages),
        name="jvllm_decode_attention",
    )(*inputs)
    out = combine_splits(o, m, l)[:, :, :group, :]  # [S, KVH, G, hd]
    return out.reshape(seqs, heads, head_dim).astype(q.dtype)
