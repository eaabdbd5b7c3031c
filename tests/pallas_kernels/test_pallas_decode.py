"""The paged decode kernel (interpret mode on CPU, compiled on a GPU) matches the gather-and-softmax reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_inputs import TOLERANCE, make_pool, random_array

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.reference import decode_attention_reference

NAN = float("nan")


def run_decode(dtype, page_size: int, head_dim: int, group: int, lengths: list[int], *, kv_heads: int = 2,
               seed: int = 0, max_pages: int | None = None, **kernel_args) -> None:
    rng = np.random.default_rng(seed)
    pool = make_pool(rng, lengths, page_size=page_size, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=dtype, max_pages=max_pages)
    q = random_array(rng, (len(lengths), kv_heads * group, head_dim), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    scale = head_dim ** -0.5
    kernel = jax.jit(functools.partial(decode_attention, scale=scale, out_fill=NAN, **kernel_args))
    out = kernel(q, pool.k_pages, pool.v_pages, pool.block_tables, lens)
    ref_args = {k: kernel_args[k] for k in ("sliding_window", "soft_cap") if k in kernel_args}
    expected = decode_attention_reference(q, pool.k_pages, pool.v_pages, pool.block_tables, lens, scale=scale,
                                          **ref_args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any(), "an output element was never written"
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **TOLERANCE[dtype])
    empty = np.asarray(lengths) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "a padded sequence row must give zeros"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (32, 128)])
def test_decode_matches_reference_with_gqa_and_padded_rows(dtype, group, page_size, head_dim):
    # lengths off page boundaries, one exactly on one, one padded (empty) row
    run_decode(dtype, page_size, head_dim, group, [37, 5, 0, 2 * page_size], num_splits=2, pages_per_block=1)


@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (32, 64)])
def test_decode_other_page_and_head_sizes(page_size, head_dim):
    run_decode(jnp.float32, page_size, head_dim, 4, [page_size + 3, 1, 0])


@pytest.mark.parametrize("num_splits,pages_per_block", [(1, 1), (3, 1), (1, 4), (4, 2)])
def test_decode_split_and_block_choices_agree(num_splits, pages_per_block):
    # uneven splits (3 over 6 pages), splits with no live page, blocks of several scrambled pages
    run_decode(jnp.float32, 16, 64, 4, [90, 17, 0, 40], max_pages=6, num_splits=num_splits,
               pages_per_block=pages_per_block)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_sliding_window(dtype, window):
    run_decode(dtype, 16, 64, 3, [70, 9, 0, 33], num_splits=2, pages_per_block=1, sliding_window=window)


def test_decode_soft_cap():
    run_decode(jnp.float32, 16, 64, 4, [45, 3, 0], soft_cap=5.0, num_splits=2, pages_per_block=1)


def test_decode_many_kv_heads_and_default_blocks():
    run_decode(jnp.bfloat16, 16, 128, 8, [31, 64, 0, 1], kv_heads=4)
