"""The Mosaic GPU ragged kernels (one warpgroup; warp-specialized) against the jnp reference: mixed steps (fresh
prefills, a chunk continuing a cached context, decode tokens, an empty row, chunks longer than one work item), sliding
windows and soft-caps; in Mosaic GPU's interpret mode on CPU (jax >= 0.11, the GPU-versions leg) or compiled on a GPU;
and their CUDA lowering."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_inputs import make_pool, ragged_batch

from test_mosaic_decode import assert_race_free, race_checked

from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels import mosaic_ragged, mosaic_ragged_ws
from pallas_kernels.ragged_attention import ragged_items
from pallas_kernels.reference import ragged_attention_reference

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU's interpret mode and plgpu.kernel "
                                "need jax >= 0.11: ci/gpu_versions_leg.sh runs these")

TOLERANCE = {jnp.bfloat16: dict(rtol=2e-2, atol=2e-2), jnp.float16: dict(rtol=4e-3, atol=4e-3)}
# name -> (queries per work item, kernel)
KERNELS = {"one_warpgroup": (mosaic_ragged.BLOCK_Q, mosaic_ragged.mosaic_ragged_paged_attention),
           "warp_specialized": (mosaic_ragged_ws.BLOCK_Q, mosaic_ragged_ws.mosaic_ragged_ws_attention)}


def run_mosaic_ragged(kernel: str, dtype, page_size: int, head_dim: int, group: int, q_lens: list[int],
                      kv_lens: list[int], *, num_tokens: int, kv_heads: int = 2, seed: int = 0, **kernel_args) -> None:
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    pool = make_pool(rng, kv_lens, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    batch = ragged_batch(rng, q_lens, kv_lens, num_tokens, heads, head_dim, dtype)
    args = (batch.q, pool.k_pages, pool.v_pages, batch.query_start, batch.q_lens, batch.kv_lens, pool.block_tables)
    block_q, attention = KERNELS[kernel]
    items = ragged_items(q_lens, block_q, num_tokens, len(q_lens))
    scale = head_dim ** -0.5
    out = attention(*args, *(jnp.asarray(a) for a in items), scale=scale, interpret=race_checked(), **kernel_args)
    reference_args = {k: kernel_args[k] for k in ("sliding_window", "soft_cap") if k in kernel_args}
    expected = np.asarray(ragged_attention_reference(*args, scale=scale, **reference_args), np.float32)
    got, real = np.asarray(out, np.float32), batch.real_tokens
    assert_race_free()
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype and np.isfinite(got).all()
    np.testing.assert_allclose(got[:real], expected[:real], **TOLERANCE[dtype])
    np.testing.assert_array_equal(got[real:], 0.0)  # padding tokens get zeros


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("group,page_size,head_dim", [(4, 16, 64), (1, 32, 128)])
def test_mixed_batch_matches_reference(kernel, dtype, group, page_size, head_dim):
    # a fresh 70-token prefill (two items of 64; one of 128 whose second half is mostly past the chunk), a chunk
    # continuing a cached context, two decode tokens, an empty row
    q_lens, kv_lens = [70, 13, 1, 1, 0], [70, 13 + 2 * page_size + 5, 40, 1, 0]
    run_mosaic_ragged(kernel, dtype, page_size, head_dim, group, q_lens, kv_lens, num_tokens=96)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_pages_of_64_tokens_two_to_a_block(kernel):
    """Larger pages (fewer, longer TMA copies per KV block): a prefill over three blocks, a chunk after cached
    context, a decode token."""
    q_lens, kv_lens = [150, 13, 1, 0], [150, 13 + 2 * 64 + 5, 40, 0]
    run_mosaic_ragged(kernel, jnp.bfloat16, 64, 64, 2, q_lens, kv_lens, num_tokens=192)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("sliding_window, soft_cap", [(8, None), (None, 2.0), (20, 3.0)])
def test_window_and_soft_cap(kernel, sliding_window, soft_cap):
    q_lens, kv_lens = [40, 9, 1], [40, 9 + 37, 60]
    run_mosaic_ragged(kernel, jnp.bfloat16, 16, 64, 2, q_lens, kv_lens, num_tokens=64, sliding_window=sliding_window,
                      soft_cap=soft_cap)


@pytest.mark.parametrize("sliding_window, ping_pong", [(None, True), (60, True), (None, False)],
                         ids=["turns", "window-turns", "no_turns"])
def test_warp_specialized_long_chunk_over_a_cached_context(sliding_window, ping_pong):
    """A 300-token chunk after 160 cached tokens (three items of 128, KV blocks of 128): an item's second consumer
    sees one more block than its first (item 0: keys up to 223 against 287), the window starts the second item's walk
    at block 1 and its second consumer's at block 2, and the last item's second consumer has no rows. With or
    without the consumers taking turns at the tensor cores."""
    run_mosaic_ragged("warp_specialized", jnp.bfloat16, 16, 128, 4, [300, 1], [460, 77], num_tokens=320,
                      sliding_window=sliding_window, ping_pong=ping_pong)


@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (150, 5.0)])
def test_warp_specialized_blocks_scored_without_a_mask(sliding_window, soft_cap):
    """A 300-token prompt after 130 cached tokens beside a fresh 40-token one: some of a consumer's blocks lie wholly
    in its rows' past (and window) and are scored without a mask, the rest (the diagonal, the window's edge, the
    sequence's end) with one; with the window, some rows see no key in their first block."""
    run_mosaic_ragged("warp_specialized", jnp.float16, 16, 64, 2, [300, 40], [430, 40], num_tokens=384,
                      sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (1024, 50.0)])
def test_lowers_for_cuda_as_one_mosaic_gpu_kernel(kernel, sliding_window, soft_cap):
    """A 2048-token prefill step of 8 sequences at Llama-3-8B's head shape (32 heads over 8 KV heads, hd 128)."""
    tokens, seqs, heads, kv_heads, head_dim, page, max_pages = 2048, 8, 32, 8, 128, 16, 128
    pool = jax.ShapeDtypeStruct((1 + seqs * max_pages, page, kv_heads, head_dim), jnp.bfloat16)
    vector = jax.ShapeDtypeStruct((seqs,), jnp.int32)
    block_q, attention = KERNELS[kernel]
    items = jax.ShapeDtypeStruct((tokens // block_q + seqs,), jnp.int32)
    args = (jax.ShapeDtypeStruct((tokens, heads, head_dim), jnp.bfloat16), pool, pool, vector, vector, vector,
            jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32), items, items)
    text = lower_for_cuda(functools.partial(attention, scale=head_dim ** -0.5, interpret=False,
                                            sliding_window=sliding_window, soft_cap=soft_cap), *args).as_text()
    assert len([line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]) == 1
