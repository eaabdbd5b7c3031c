"""jax's own GPU attention kernels, set up as `benchmarks/kernels.py` times them beside jvllm's: the shipped Pallas
paged decode kernel and the Mosaic GPU flash attention."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


def shipped_paged_attention(context: int, page_size: int, interpret: bool) -> Callable:
    """jax.experimental.pallas.ops.gpu.paged_attention with a valid split for this context length."""
    from jax.experimental.pallas.ops.gpu import paged_attention as shipped

    pages_per_seq = -(-context // page_size)
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    per_split = pages_per_seq // k_splits
    per_block = next(b for b in (8, 4, 2, 1) if per_split % b == 0)
    return jax.jit(functools.partial(shipped.paged_attention, k_splits=k_splits, pages_per_compute_block=per_block,
                                     interpret=interpret))


def mosaic_flash_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, scale: float, *,
                           seqs: int, tokens_per_seq: int) -> tuple[Callable, tuple] | None:
    """jax's Mosaic GPU flash attention over `seqs` equal sequences (q [T, H, hd] flat; causal; dense [B, T, H, hd]
    K/V gathered from the [N, page, KVH, hd] pages outside the timed region) as (fn, args) returning the ragged
    kernels' [T, H, hd] layout; None where jax lacks it. In float16: jax 0.11.2's kernel fails on bfloat16 inputs
    ("src had type bfloat16 and dst had type float16"); the two types cost the same."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except ImportError:
        return None
    heads, head_dim = q.shape[1:]
    kv_heads = k_pages.shape[2]
    dense = lambda pages: pages[tables].reshape(seqs, -1, kv_heads, head_dim)[:, :tokens_per_seq]  # noqa: E731
    k, v = dense(k_pages).astype(jnp.float16), dense(v_pages).astype(jnp.float16)
    q4 = (q.astype(jnp.float32) * scale).astype(jnp.float16).reshape(seqs, tokens_per_seq, heads, head_dim)
    # it applies no softmax scale: q is pre-scaled, as for the shipped decode kernel
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)

    def flash(q4, k, v):
        return attention_mgpu.attention(q4, k, v, config).reshape(-1, heads, head_dim).astype(q.dtype)

    return jax.jit(flash), (q4, k, v)
