"""Shared pieces of the Triton-style Pallas kernels: interpret switch, block checks, one online-softmax step."""
from __future__ import annotations

import os

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


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # o [R, hd] f32, m [R] f32, l [R] f32
    q: jax.Array,  # [R, hd]
    k: jax.Array,  # [BK, hd]
    v: jax.Array,  # [BK, hd]
    visible: jax.Array,  # [R, BK] bool
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention block: scores, mask, rescale the running max/sum/output, accumulate p @ v."""
    o, m, l = carry
    if k.dtype != q.dtype:  # e.g. f32 activations over a bf16 pool: tl.dot wants one operand type
        k = k.astype(q.dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_new)
    # zero masked probabilities explicitly: a row whose keys so far are all masked has m_new == MASK_VALUE
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return o * correction[:, None] + pv, m_new, l


def load_kv_block(
    pages_ref,  # [N, page, KVH, hd] ref
    block_table_ref,  # [S, P] ref
    seq,  # scalar
    kv_head,  # scalar
    block: jax.Array,  # scalar: index of the block of `pages_per_block` pages in the sequence
    pages_per_block: int,
    valid: jax.Array,  # [BK] bool: key slots that hold real tokens
) -> jax.Array:
    """Gather `pages_per_block` pages of one KV head -> [BK, hd], zeroing slots past the sequence so stale
    (even NaN) pool contents never reach p @ v (0 * NaN is NaN)."""
    page_ids = block_table_ref[seq, pl.ds(block * pages_per_block, pages_per_block)]  # [ppb]
    tile = pages_ref[page_ids, :, kv_head, :]  # [ppb, page, hd]
    tile = tile.reshape(tile.shape[0] * tile.shape[1], tile.shape[2])
    return jnp.where(valid[:, None], tile, jnp.zeros_like(tile))

