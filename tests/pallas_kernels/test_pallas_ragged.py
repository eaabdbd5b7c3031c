"""The ragged paged-attention kernel (interpret mode on CPU, compiled on a GPU) matches the reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_inputs import TOLERANCE, make_pool, ragged_batch

from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_attention_reference

NAN = float("nan")


def run_ragged(dtype, page_size: int, head_dim: int, group: int, q_lens: list[int], kv_lens: list[int], *,
               num_tokens: int, max_q_len: int, kv_heads: int = 2, seed: int = 0, **kernel_args) -> None:
    rng = np.random.default_rng(seed)
    pool = make_pool(rng, kv_lens, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    batch = ragged_batch(rng, q_lens, kv_lens, num_tokens, kv_heads * group, head_dim, dtype)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    scale = head_dim ** -0.5
    kernel = jax.jit(functools.partial(ragged_paged_attention, max_q_len=max_q_len, scale=scale,
                                       out_fill=NAN, **kernel_args))
    out = np.asarray(kernel(*args), np.float32)
    ref_args = {k: kernel_args[k] for k in ("sliding_window", "soft_cap") if k in kernel_args}
    expected = np.asarray(ragged_attention_reference(*args, max_q_len=max_q_len, scale=scale, **ref_args),
                          np.float32)
    real = batch.real_tokens
    assert not np.isnan(out[:real]).any(), "a real token's output was not written (or read a poisoned slot)"
    np.testing.assert_allclose(out[:real], expected[:real], **TOLERANCE[dtype])
    assert np.isnan(out[real:]).all(), "padding token rows must be left alone"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (32, 128)])
def test_ragged_mixed_batch_matches_reference(dtype, group, page_size, head_dim):
    # a fresh prefill, a chunked prefill continuing a cached context, two decode tokens, an empty row
    q_lens, kv_lens = [19, 13, 1, 1, 0], [19, 13 + 2 * page_size + 5, 40, 1, 0]
    run_ragged(dtype, page_size, head_dim, group, q_lens, kv_lens, num_tokens=40, max_q_len=32)


@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (32, 64)])
def test_ragged_other_page_and_head_sizes(page_size, head_dim):
    run_ragged(jnp.float32, page_size, head_dim, 4, [9, 1, 0], [9, 50, 0], num_tokens=16, max_q_len=16)


@pytest.mark.parametrize("block_q,pages_per_block", [(16, 1), (4, 4), (32, 2)])
def test_ragged_block_choices_agree(block_q, pages_per_block):
    # query chunks spanning several query blocks, key blocks of several scrambled pages
    run_ragged(jnp.float32, 16, 64, 4, [37, 2, 23], [37, 70, 60], num_tokens=64, max_q_len=64,
               block_q=block_q, pages_per_block=pages_per_block)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [1, 6, 40])
def test_ragged_sliding_window(dtype, window):
    run_ragged(dtype, 16, 64, 3, [30, 1, 12, 0], [30, 45, 50, 0], num_tokens=48, max_q_len=32,
               sliding_window=window, block_q=8)


def test_ragged_soft_cap():
    run_ragged(jnp.float32, 16, 64, 4, [20, 1], [20, 33], num_tokens=24, max_q_len=32, soft_cap=5.0)


def test_ragged_decode_only_batch_through_ragged_kernel():
    run_ragged(jnp.bfloat16, 32, 128, 8, [1, 1, 1, 0], [1, 33, 64, 0], num_tokens=4, max_q_len=1)


def test_ragged_full_batch_without_padding_tokens():
    q_lens = [16, 16]
    rng = np.random.default_rng(3)
    pool = make_pool(rng, q_lens, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.float32)
    batch = ragged_batch(rng, q_lens, q_lens, 32, 8, 64, jnp.float32)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    out = ragged_paged_attention(*args, max_q_len=16, scale=0.125)
    expected = ragged_attention_reference(*args, max_q_len=16, scale=0.125)
    np.testing.assert_allclose(out, expected, **TOLERANCE[jnp.float32])


def test_float32_queries_over_a_bfloat16_pool():
    rng = np.random.default_rng(4)
    q_lens, kv_lens = [11, 1], [11, 30]
    pool = make_pool(rng, kv_lens, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    batch = ragged_batch(rng, q_lens, kv_lens, 16, 8, 64, jnp.float32)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    out = ragged_paged_attention(*args, max_q_len=16, scale=0.125)
    expected = ragged_attention_reference(*args, max_q_len=16, scale=0.125)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out[:12], expected[:12], **TOLERANCE[jnp.bfloat16])
