"""Shared pieces of the Triton-style Pallas kernels: interpret switch, block checks, one online-softmax step."""
from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MASK_VALUE = -1e30  # finite: a fully masked row keeps m = MASK_VALUE, l = 0, o = 0 and never makes NaN


def default_interpret() -> bool:
    """Interpret mode unless running on a GPU; JVLLM_PALLAS_INTERPRET=1 forces it, =0 forces compiled
    kernels (cross-lowering for CUDA on a CPU machine)."""
    forced = os.environ.get("JVLLM_PALLAS_INTERPRET", "")
    if forced in ("0", "1"):
        return forced == "1"
    return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else interpret


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    """Selects the Triton lowering (pallas_call defaults to Mosaic GPU since jax 0.9)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_pow2(**sizes: int) -> None:
    """Triton tensors (loads, stores, dots) need power-of-two sizes; fail early with a readable message."""
    for name, size in sizes.items():
        if not is_pow2(size):
            raise ValueError(f"{name}={size} must be a power of two for the Triton lowering")


def check_min_rows(rows: int) -> None:
    """tl.dot needs at least 16 rows per operand tile."""
    if rows < 16:
        raise ValueError(f"query rows per block ({rows}) must be >= 16 for tl.dot")


def cdiv(a, b):
    return (a + b - 1) // b


def dot_precision(dtype) -> jax.lax.Precision:
    """float32 operands ask for full float32 products (Triton `inputPrecision = ieee`); the default would be
    TF32 on a GPU (10-bit mantissa, errors ~4e-4). 16-bit operands keep the default: their products are exact
    in the float32 accumulator either way."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # o [R, hd] f32, m [R] f32, l [R] f32
    q: Sequence[jax.Array],  # chunks of the head dim: [R, hd / chunks] each
    k: Sequence[jax.Array],  # the same chunks of the keys: [BK, hd / chunks] each
    v: jax.Array,  # [BK, hd]
    visible: jax.Array,  # [R, BK] bool
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention block: scores (summed over the head-dim chunks), mask, rescale the running
    max/sum/output, accumulate p @ v."""
    o, m, l = carry
    s = None
    for q_chunk, k_chunk in zip(q, k, strict=True):
        if k_chunk.dtype != q_chunk.dtype:  # e.g. f32 activations over a bf16 pool: tl.dot wants one type
            k_chunk = k_chunk.astype(q_chunk.dtype)
        part = jax.lax.dot_general(q_chunk, k_chunk, (((1,), (1,)), ((), ())),
                                   precision=dot_precision(q_chunk.dtype), preferred_element_type=jnp.float32)
        s = part if s is None else s + part
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_new)
    # zero masked probabilities explicitly: a row whose keys so far are all masked has m_new == MASK_VALUE
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=dot_precision(v.dtype),
                             preferred_element_type=jnp.float32)
    return o * correction[:, None] + pv, m_new, l


def load_kv_block(
    pages_ref,  # [N, page, KVH, hd] ref
    block_table_ref,  # [S, P] ref
    seq,  # scalar
    kv_head,  # scalar
    block: jax.Array,  # scalar: index of the block of `pages_per_block` pages in the sequence
    pages_per_block: int,
    valid: jax.Array | None,  # [BK] bool: key slots that hold real tokens; None keeps every slot as loaded
    columns: slice = slice(None),  # a static or pl.ds range of the head dim
) -> jax.Array:
    """Gather `pages_per_block` pages of one KV head -> [BK, hd] (or its `columns`). With `valid`, slots past
    the sequence are zeroed, so stale (even NaN) pool contents never reach p @ v (0 * NaN is NaN). Keys need
    no zeroing: the scores of invisible slots are replaced by MASK_VALUE before use (and skipping the select
    saves float32 kernels a spill)."""
    page_ids = block_table_ref[seq, pl.ds(block * pages_per_block, pages_per_block)]  # [ppb]
    tile = pages_ref[page_ids, :, kv_head, columns]  # [ppb, page, hd or columns]
    tile = tile.reshape(tile.shape[0] * tile.shape[1], tile.shape[2])
    if valid is None:
        return tile
    return jnp.where(valid[:, None], tile, jnp.zeros_like(tile))

