"""The ragged paged-attention kernel (interpret mode on CPU, compiled on a GPU) matches the reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_inputs import TOLERANCE, make_pool, ragged_batch

from pallas_kernels.ragged_attention import ragged_block_q, ragged_items, ragged_paged_attention
from pallas_kernels.reference import ragged_attention_reference

NAN = float("nan")


def work_items(dtype, q_lens: list[int], num_tokens: int, heads: int, kv_heads: int, head_dim: int,
               block_q: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(item_seq, item_first) as the host builds them, at `block_q` or the kernel's default for these shapes."""
    block_q = block_q or ragged_block_q(dtype, dtype, heads, kv_heads, head_dim)
    return ragged_items(q_lens, block_q, num_tokens, len(q_lens))


@pytest.mark.parametrize("block_q", [16, 64, 128])
def test_work_items_cover_each_sequence_in_order(block_q):
    """Each sequence with queries gets ceil(q_len / block_q) items in sequence order, first = 0, block_q, ...; the
    rest are unused (first = num_tokens), for random batches with empty rows and padding tokens."""
    rng = np.random.default_rng(block_q)
    for _ in range(50):
        q_lens = [int(n) for n in rng.integers(0, 5 * block_q, int(rng.integers(1, 40))) * (rng.random() < 0.8)]
        num_tokens = sum(q_lens) + int(rng.integers(0, block_q))
        item_seq, item_first = ragged_items(np.asarray(q_lens), block_q, num_tokens, len(q_lens))
        expected = [(seq, first) for seq, q_len in enumerate(q_lens) for first in range(0, q_len, block_q)]
        assert item_seq.dtype == item_first.dtype == np.int32
        assert item_seq.shape == item_first.shape == (-(-num_tokens // block_q) + len(q_lens),)
        assert list(zip(item_seq[:len(expected)].tolist(), item_first[:len(expected)].tolist())) == expected
        assert (item_first[len(expected):] == num_tokens).all()


def run_ragged(dtype, page_size: int, head_dim: int, group: int, q_lens: list[int], kv_lens: list[int], *,
               num_tokens: int, kv_heads: int = 2, seed: int = 0, **kernel_args) -> tuple[np.ndarray, np.ndarray]:
    """The kernel (NaN where it writes nothing) against the reference; -> the work items it ran."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    pool = make_pool(rng, kv_lens, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    batch = ragged_batch(rng, q_lens, kv_lens, num_tokens, heads, head_dim, dtype)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    items = work_items(dtype, q_lens, num_tokens, heads, kv_heads, head_dim, kernel_args.get("block_q"))
    scale = head_dim ** -0.5
    kernel = jax.jit(functools.partial(ragged_paged_attention, scale=scale, out_fill=NAN, **kernel_args))
    out = np.asarray(kernel(*args, *items), np.float32)
    ref_args = {k: kernel_args[k] for k in ("sliding_window", "soft_cap") if k in kernel_args}
    expected = np.asarray(ragged_attention_reference(*args, scale=scale, **ref_args), np.float32)
    real = batch.real_tokens
    assert not np.isnan(out[:real]).any(), "a real token's output was not written (or read a poisoned slot)"
    np.testing.assert_allclose(out[:real], expected[:real], **TOLERANCE[dtype])
    assert np.isnan(out[real:]).all(), "padding token rows must be left alone"
    return items


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (32, 128)])
def test_ragged_mixed_batch_matches_reference(dtype, group, page_size, head_dim):
    # a fresh prefill, a chunked prefill continuing a cached context, two decode tokens, an empty row
    q_lens, kv_lens = [19, 13, 1, 1, 0], [19, 13 + 2 * page_size + 5, 40, 1, 0]
    run_ragged(dtype, page_size, head_dim, group, q_lens, kv_lens, num_tokens=40)


@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (32, 64)])
def test_ragged_other_page_and_head_sizes(page_size, head_dim):
    run_ragged(jnp.float32, page_size, head_dim, 4, [9, 1, 0], [9, 50, 0], num_tokens=16)


@pytest.mark.parametrize("block_q,pages_per_block", [(16, 1), (4, 4), (32, 2)])
def test_ragged_block_choices_agree(block_q, pages_per_block):
    # query chunks spanning several query blocks, key blocks of several scrambled pages
    run_ragged(jnp.float32, 16, 64, 4, [37, 2, 23], [37, 70, 60], num_tokens=64,
               block_q=block_q, pages_per_block=pages_per_block)


def test_ragged_decode_rows_around_one_long_prefill():
    """Most work items belong to one long chunk (continuing a cached context) between many decode rows: the
    items of one sequence follow each other, and every row still gets its own."""
    decode_contexts = [5, 17, 33, 2, 40, 9, 1, 26, 12, 30]
    q_lens = [1] * 4 + [61] + [1] * 6 + [0]
    kv_lens = decode_contexts[:4] + [61 + 20] + decode_contexts[4:] + [0]
    item_seq, item_first = run_ragged(jnp.float32, 16, 64, 4, q_lens, kv_lens, num_tokens=80, block_q=4)
    used = item_first < 80
    assert used.sum() == 10 + 16 and (item_seq[used] == 4).sum() == 16  # 16 of the 26 items: the long chunk
    np.testing.assert_array_equal(item_first[used][item_seq[used] == 4], np.arange(0, 61, 4))


def test_ragged_unused_items_of_a_mostly_empty_step_never_write():
    """A step shape far larger than its tokens: nearly every item is unused (item_first = T), and every row
    past the real tokens keeps its NaN fill."""
    item_seq, item_first = run_ragged(jnp.float32, 16, 64, 2, [5, 1, 0, 0], [5, 20, 0, 0], num_tokens=256,
                                      block_q=8)
    assert len(item_first) == 256 // 8 + 4 and (item_first < 256).sum() == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [1, 6, 40])
def test_ragged_sliding_window(dtype, window):
    run_ragged(dtype, 16, 64, 3, [30, 1, 12, 0], [30, 45, 50, 0], num_tokens=48, sliding_window=window, block_q=8)


def test_ragged_soft_cap():
    run_ragged(jnp.float32, 16, 64, 4, [20, 1], [20, 33], num_tokens=24, soft_cap=5.0)


def test_ragged_decode_only_batch_through_ragged_kernel():
    run_ragged(jnp.bfloat16, 32, 128, 8, [1, 1, 1, 0], [1, 33, 64, 0], num_tokens=4)


def test_ragged_full_batch_without_padding_tokens():
    q_lens = [16, 16]
    rng = np.random.default_rng(3)
    pool = make_pool(rng, q_lens, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.float32)
    batch = ragged_batch(rng, q_lens, q_lens, 32, 8, 64, jnp.float32)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    out = ragged_paged_attention(*args, *work_items(jnp.float32, q_lens, 32, 8, 2, 64), scale=0.125)
    expected = ragged_attention_reference(*args, scale=0.125)
    np.testing.assert_allclose(out, expected, **TOLERANCE[jnp.float32])


def test_float32_queries_over_a_bfloat16_pool():
    rng = np.random.default_rng(4)
    q_lens, kv_lens = [11, 1], [11, 30]
    pool = make_pool(rng, kv_lens, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    batch = ragged_batch(rng, q_lens, kv_lens, 16, 8, 64, jnp.float32)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    items = ragged_items(q_lens, ragged_block_q(jnp.float32, jnp.bfloat16, 8, 2, 64), 16, 2)
    out = ragged_paged_attention(*args, *items, scale=0.125)
    expected = ragged_attention_reference(*args, scale=0.125)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out[:12], expected[:12], **TOLERANCE[jnp.bfloat16])
