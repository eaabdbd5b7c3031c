"""Default block sizes, warps and pipeline stages per kernel, operand width and head dim (from docs/pallas.md's table)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.common import next_pow2


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel's default launch. `block_rows` (ragged only) is query rows per program, block_q tokens times
    the padded GQA group; `block_tokens` is keys per loop step (pages_per_block * page_size); `qk_chunks`
    (ragged only) splits the q @ k^T contraction into that many head-dim slices, each loaded and dotted on its
    own (a float32 FMA dot over 256 products per output spills in ptxas)."""

    block_tokens: int
    num_warps: int
    num_stages: int
    block_rows: int = 0
    qk_chunks: int = 1


# Each entry compiles for sm_90 without register spills or local stack (triton 3.6 + ptxas 12.8, jax 0.11.2's
# Triton IR); tests/pallas_kernels/test_pallas_triton_compile.py checks every variant. Keyed by
# (16-bit or 32-bit operands, head dim). float32 dots are IEEE (FMA, no tensor cores): software pipelining
# (2 stages) makes ptxas spill there, so the float32 kernels run unpipelined with 8 warps and small tiles.
_DECODE = {
    (16, 64): Launch(block_tokens=128, num_warps=4, num_stages=2),  # 16 KiB K tiles, 3-4 CTAs per SM
    (16, 128): Launch(block_tokens=64, num_warps=4, num_stages=2),
    (16, 256): Launch(block_tokens=32, num_warps=4, num_stages=2),
    (32, 64): Launch(block_tokens=64, num_warps=8, num_stages=1),
    (32, 128): Launch(block_tokens=32, num_warps=8, num_stages=1),
    (32, 256): Launch(block_tokens=32, num_warps=8, num_stages=1),
}
_RAGGED = {
    (16, 64): Launch(block_rows=128, block_tokens=32, num_warps=8, num_stages=2),
    (16, 128): Launch(block_rows=128, block_tokens=64, num_warps=8, num_stages=2),
    (16, 256): Launch(block_rows=64, block_tokens=32, num_warps=8, num_stages=2),
    (32, 64): Launch(block_rows=16, block_tokens=32, num_warps=8, num_stages=1),
    (32, 128): Launch(block_rows=16, block_tokens=64, num_warps=8, num_stages=1, qk_chunks=2),
    (32, 256): Launch(block_rows=16, block_tokens=32, num_warps=8, num_stages=1, qk_chunks=2),
}
TUNED_HEAD_DIMS = (64, 128, 256)


def _key(q_dtype, kv_dtype, head_dim: int) -> tuple[int, int]:
    """(operand bits, tuned head dim): a float32 query over a 16-bit pool still makes float32 dots; head dims
    take the next tuned size up (32 -> 64), above 256 the 256 entry (its callers shrink the key block)."""
    bits = 32 if max(jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize) >= 4 else 16
    return bits, next((h for h in TUNED_HEAD_DIMS if head_dim <= h), TUNED_HEAD_DIMS[-1])


def _scaled(launch: Launch, head_dim: int) -> Launch:
    """Head dims above the table keep the 256 entry's tile bytes by taking fewer keys per block."""
    if head_dim <= TUNED_HEAD_DIMS[-1]:
        return launch
    factor = -(-head_dim // TUNED_HEAD_DIMS[-1])
    return dataclasses.replace(launch, block_tokens=max(16, launch.block_tokens // factor),
                               block_rows=max(16, launch.block_rows // factor) if launch.block_rows else 0,
                               qk_chunks=launch.qk_chunks * factor if launch.qk_chunks > 1 else 1)


def decode_launch(q_dtype, kv_dtype, head_dim: int) -> Launch:
    return _scaled(_DECODE[_key(q_dtype, kv_dtype, head_dim)], head_dim)


def ragged_launch(q_dtype, kv_dtype, head_dim: int) -> Launch:
    return _scaled(_RAGGED[_key(q_dtype, kv_dtype, head_dim)], head_dim)


def pages_per_block(block_tokens: int, page_size: int, max_pages: int) -> int:
    """Whole pages per key block (at least one), no more than the padded block table holds."""
    return min(max(1, block_tokens // page_size), next_pow2(max_pages))
