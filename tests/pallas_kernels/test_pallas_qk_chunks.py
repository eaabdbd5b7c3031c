"""The ragged kernel with q @ k^T split into head-dim chunks (the float32 head-dim-256 default) matches the reference."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import launch
from pallas_kernels.ragged_attention import ragged_block_q, ragged_items, ragged_paged_attention
from pallas_kernels.reference import ragged_attention_reference

F32_TOLERANCE = dict(atol=2e-5, rtol=2e-5)


def ragged_inputs(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int], *, page_size: int,
                  kv_heads: int, group: int, head_dim: int) -> tuple[jnp.ndarray, ...]:
    """(q [T, H, hd], k_pages, v_pages [N, page, KVH, hd], query_start, q_lens, kv_lens [S], block_tables
    [S, P]) in float32; each sequence owns distinct pages (never page 0) in scrambled order, and every slot no
    sequence owns holds NaN."""
    pages_each = [-(-n // page_size) for n in kv_lens]
    num_pages = 1 + sum(pages_each)
    order = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(kv_lens), max(pages_each)), np.int32)
    owned = np.zeros((num_pages, page_size), bool)
    cursor = 0
    for row, (count, length) in enumerate(zip(pages_each, kv_lens)):
        tables[row, :count] = order[cursor:cursor + count]
        cursor += count
        for pos in range(length):
            owned[tables[row, pos // page_size], pos % page_size] = True
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = (np.where(owned[:, :, None, None], rng.standard_normal(shape), np.nan) for _ in "kv")
    q = rng.standard_normal((sum(q_lens), kv_heads * group, head_dim))
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    return tuple(jnp.asarray(x, dtype) for x, dtype in (
        (q, jnp.float32), (k_pages, jnp.float32), (v_pages, jnp.float32), (starts, jnp.int32),
        (q_lens, jnp.int32), (kv_lens, jnp.int32), (tables, jnp.int32)))


def test_float32_head_dim_256_defaults_to_two_chunks():
    assert launch.ragged_launch(jnp.float32, jnp.float32, 256).qk_chunks == 2
    assert launch.ragged_launch(jnp.bfloat16, jnp.bfloat16, 256).qk_chunks == 1


@pytest.mark.parametrize("head_dim,qk_chunks", [(256, None), (64, 2), (64, 4)])
def test_chunked_scores_match_the_reference(head_dim, qk_chunks):
    # a prefill, a chunk continuing a cached context, a decode token; GQA 3 (padded to 4 heads)
    q_lens, kv_lens = [9, 5, 1], [9, 21, 30]
    args = ragged_inputs(np.random.default_rng(0), q_lens, kv_lens, page_size=16, kv_heads=1, group=3,
                         head_dim=head_dim)
    scale = head_dim ** -0.5
    block_q = ragged_block_q(jnp.float32, jnp.float32, 3, 1, head_dim)
    items = ragged_items(q_lens, block_q, sum(q_lens), len(q_lens))
    out = ragged_paged_attention(*args, *items, scale=scale, qk_chunks=qk_chunks, interpret=True)
    expected = ragged_attention_reference(*args, scale=scale)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), **F32_TOLERANCE)
