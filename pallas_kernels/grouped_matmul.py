"""Grouped matmul for mixture-of-experts layers: rows sorted by group times that group's matrix, as a Pallas
(Triton) kernel with `jax.lax.ragged_dot`'s contract.

The grid walks flat work items, one per (group, row tile) pair the group's rows touch, so a tile that straddles
two groups is computed once per group with the other group's rows masked out. The item count is static
(row tiles + groups - 1, its upper bound); the items past the real count store nothing."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common

MAX_BLOCK_N = 64
MAX_BLOCK_K = 32
MIN_BLOCK = 16  # tl.dot's smallest operand tile


def work_items(group_sizes: jax.Array, num_row_tiles: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """group_sizes [G] -> (item_group, item_tile [num_row_tiles + G - 1] int32, number of real items [] int32).

    Items are ordered by group, then by row tile; a group with no rows has no item."""
    sizes = group_sizes.astype(jnp.int32)
    num_groups = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = starts // block_m
    tiles = jnp.where(sizes > 0, (ends - 1) // block_m - first_tile + 1, 0)  # [G]
    capacity = num_row_tiles + num_groups - 1
    item_group = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), tiles, total_repeat_length=capacity)
    first_item = jnp.cumsum(tiles) - tiles  # [G]
    item = jnp.arange(capacity, dtype=jnp.int32)
    item_tile = first_tile[item_group] + item - first_item[item_group]
    return item_group, item_tile, jnp.sum(tiles).astype(jnp.int32)


def _block(size: int, limit: int, name: str) -> int:
    """The largest power of two <= limit that divides `size` (at least tl.dot's 16)."""
    block = limit
    while block >= MIN_BLOCK and size % block:
        block //= 2
    if block < MIN_BLOCK:
        raise ValueError(f"{name}={size} must be a multiple of {MIN_BLOCK} for the grouped-matmul kernel")
    return block


def _grouped_kernel(item_group_ref, item_tile_ref, num_items_ref, starts_ref, ends_ref, lhs_ref, rhs_ref,
                    _out_in_ref, out_ref, *, block_m: int, block_n: int, block_k: int):
    item, col_block = pl.program_id(0), pl.program_id(1)
    group, tile = item_group_ref[item], item_tile_ref[item]
    rows = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [BM]
    in_group = (rows >= starts_ref[group]) & (rows < ends_ref[group]) & (item < num_items_ref[0])
    row_ids = pl.ds(tile * block_m, block_m)
    cols = pl.ds(col_block * block_n, block_n)
    lhs_dtype = lhs_ref.dtype

    def accumulate(k_block, acc):
        depth = pl.ds(k_block * block_k, block_k)
        a = lhs_ref[row_ids, depth]  # [BM, BK]
        b = rhs_ref[group, depth, cols].astype(lhs_dtype)  # [BK, BN]
        return acc + jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=common.dot_precision(lhs_dtype),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, lhs_ref.shape[1] // block_k, accumulate, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(out_ref.at[row_ids, cols], acc.astype(out_ref.dtype), mask=in_group[:, None])


def grouped_matmul(
    lhs: jax.Array,  # [M, K] rows sorted by group
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int: rows of each group, in order; rows past their sum are zeros in the output
    *,
    preferred_element_type: jnp.dtype = jnp.float32,
    block_m: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> jax.Array:
    """-> [M, N]: row r of group g is lhs[r] @ rhs[g] (jax.lax.ragged_dot's ragged-rows case)."""
    m, k = lhs.shape
    num_groups, _, n = rhs.shape
    common.check_pow2(block_m=block_m)
    common.check_min_rows(block_m)
    block_n, block_k = _block(n, MAX_BLOCK_N, "N"), _block(k, MAX_BLOCK_K, "K")
    num_row_tiles = common.cdiv(m, block_m)
    padded_m = num_row_tiles * block_m
    lhs = jnp.pad(lhs, ((0, padded_m - m), (0, 0)))
    item_group, item_tile, num_items = work_items(group_sizes, num_row_tiles, block_m)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    kernel = functools.partial(_grouped_kernel, block_m=block_m, block_n=block_n, block_k=block_k)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded_m, n), preferred_element_type),
        grid=(item_group.shape[0], n // block_n),
        input_output_aliases={7: 0},
        interpret=common.resolve_interpret(interpret),
        compiler_params=common.compiler_params(num_warps, num_stages),
        name="jvllm_grouped_matmul",
    )(item_group, item_tile, num_items[None], starts, ends, lhs, rhs, jnp.zeros((padded_m, n), preferred_element_type))
    return out[:m]
