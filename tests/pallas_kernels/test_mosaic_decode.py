"""The Mosaic GPU decode kernel against the jnp reference: interpret mode on CPU (jax >= 0.11, the GPU-versions leg),
compiled on a GPU; and its lowering for CUDA under an abstract H100 (one Mosaic GPU custom call)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU's interpret mode and plgpu.kernel "
                                "need jax >= 0.11: ci/gpu_versions_leg.sh runs these")

from pallas_inputs import make_pool, random_array  # noqa: E402

from pallas_kernels.cuda_lowering import lower_for_cuda  # noqa: E402
from pallas_kernels.mosaic_decode import mosaic_decode_attention  # noqa: E402
from pallas_kernels.reference import decode_attention_reference  # noqa: E402

def _raises_on_race() -> bool:
    """Whether this jax's interpret mode raises on a race itself (`on_race`, jax 0.12); jax 0.11 records them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return "on_race" in {field.name for field in dataclasses.fields(plgpu.InterpretGPUParams)}


def race_checked():
    """Mosaic GPU's interpret mode with its happens-before race detector off a GPU; compiled on a GPU (None)."""
    if jax.default_backend() == "gpu":
        return None
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=True, **({"on_race": "raise"} if _raises_on_race() else {}))


def assert_race_free() -> None:
    """After a kernel interpreted with `race_checked()` has finished: on jax 0.11, its race detector's record holds
    no race (jax 0.12 has raised already; a GPU run is compiled)."""
    if jax.default_backend() == "gpu" or _raises_on_race():
        return
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    assert not gpu_callbacks.get_races().races_found, "the race detector found a race (printed above)"


TOLERANCE = {jnp.bfloat16: dict(rtol=2e-2, atol=2e-2), jnp.float16: dict(rtol=4e-3, atol=4e-3)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kv_heads, group, head_dim, page, pages_per_block", [
    (2, 4, 64, 16, 4),  # GQA 4, 64-token blocks
    (1, 8, 128, 16, 8),  # GQA 8, head 128, 128-token blocks
    (2, 1, 64, 32, 2),  # no GQA, 32-token pages
])
def test_matches_reference_over_uneven_lengths(dtype, kv_heads, group, head_dim, page, pages_per_block):
    """Slots no sequence owns hold NaN (pallas_inputs.make_pool): a kernel that lets them into a result fails."""
    rng = np.random.default_rng(kv_heads * 100 + group * 10 + page)
    block = page * pages_per_block
    # empty (a padding row), one key, a block boundary, one past it, two and a half blocks
    lengths = [0, 1, block, block + 1, 5 * block // 2]
    pool = make_pool(rng, lengths, page_size=page, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = random_array(rng, (len(lengths), kv_heads * group, head_dim), dtype)
    scale = head_dim ** -0.5
    args = (q, pool.k_pages, pool.v_pages, pool.block_tables, jnp.asarray(lengths, jnp.int32))
    out = mosaic_decode_attention(*args, scale=scale, pages_per_block=pages_per_block, interpret=race_checked())
    expected = decode_attention_reference(*args, scale=scale)
    got, want = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert_race_free()
    assert out.shape == q.shape and out.dtype == q.dtype and np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], 0.0)  # a padding row attends to nothing
    np.testing.assert_allclose(got[1:], want[1:], **TOLERANCE[dtype])
    # one key: the output is that key's value row for every query head of its KV head
    first_v = np.asarray(pool.v_pages[int(pool.block_tables[1, 0]), 0], np.float32)  # [KVH, hd]
    np.testing.assert_allclose(got[1].reshape(kv_heads, group, head_dim), np.repeat(first_v[:, None], group, 1),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("sliding_window, soft_cap", [(8, None), (None, 2.0), (40, 3.0)])
def test_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(7)
    lengths = [1, 9, 70, 100]
    pool = make_pool(rng, lengths, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    q = random_array(rng, (len(lengths), 8, 64), jnp.bfloat16)
    args = (q, pool.k_pages, pool.v_pages, pool.block_tables, jnp.asarray(lengths, jnp.int32))
    options = dict(scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    out = mosaic_decode_attention(*args, **options)
    expected = decode_attention_reference(*args, **options)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               **TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize("slots", [3, 4])
def test_deeper_prefetch_matches_reference(slots):
    """slots - 1 blocks in flight: 64-token blocks, lengths from part of one block to six and a half, so the slots
    wrap round more than once and the first prefetches run past short sequences' ends."""
    rng = np.random.default_rng(slots)
    lengths = [0, 30, 64, 130, 200, 416]
    pool = make_pool(rng, lengths, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    q = random_array(rng, (len(lengths), 8, 64), jnp.bfloat16)
    args = (q, pool.k_pages, pool.v_pages, pool.block_tables, jnp.asarray(lengths, jnp.int32))
    out = mosaic_decode_attention(*args, scale=0.125, pages_per_block=4, slots=slots, interpret=race_checked())
    expected = decode_attention_reference(*args, scale=0.125)
    assert_race_free()
    got = np.asarray(out, np.float32)
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got[1:], np.asarray(expected, np.float32)[1:], **TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize("splits, sliding_window", [(2, None), (3, None), (3, 40)])
def test_keys_split_over_programs_match_reference(splits, sliding_window):
    """Each (sequence, KV head)'s blocks in `splits` shares: lengths with fewer blocks than shares (the last shares
    empty), an empty row, and several blocks per share; with a window, shares of the window's blocks only."""
    rng = np.random.default_rng(10 + splits)
    lengths = [0, 30, 64, 130, 200, 416]
    pool = make_pool(rng, lengths, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    q = random_array(rng, (len(lengths), 8, 64), jnp.bfloat16)
    args = (q, pool.k_pages, pool.v_pages, pool.block_tables, jnp.asarray(lengths, jnp.int32))
    options = dict(scale=0.125, sliding_window=sliding_window)
    out = mosaic_decode_attention(*args, **options, pages_per_block=4, splits=splits, interpret=race_checked())
    expected = decode_attention_reference(*args, **options)
    assert_race_free()
    got = np.asarray(out, np.float32)
    assert out.shape == q.shape and out.dtype == q.dtype and np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got[1:], np.asarray(expected, np.float32)[1:], **TOLERANCE[jnp.bfloat16])


def test_merging_shares_weighs_each_by_its_log_sum_exp():
    """Two shares of one row's keys: the merge of their normalised outputs by base-2 log-sum-exps is the softmax
    over all keys; a share that saw no key (lse -inf, output 0) weighs nothing; a row no share saw stays zero."""
    from pallas_kernels.mosaic_decode import merge_splits

    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=7), rng.normal(size=(7, 3))
    halves = [slice(0, 4), slice(4, 7)]
    lse = np.array([np.log2(np.sum(np.exp2(scores[h]))) for h in halves] + [-np.inf])  # [P]
    parts = np.stack([np.exp2(scores[h]) @ values[h] / np.sum(np.exp2(scores[h])) for h in halves]
                     + [np.zeros(3)])  # [P, hd]
    merged = merge_splits(jnp.asarray(parts[:, None]), jnp.asarray(lse[:, None], jnp.float32))  # G = 1
    np.testing.assert_allclose(np.asarray(merged)[0], np.exp2(scores) @ values / np.sum(np.exp2(scores)), rtol=1e-5)
    empty = merge_splits(jnp.zeros((3, 1, 3)), jnp.full((3, 1), -jnp.inf))
    np.testing.assert_array_equal(np.asarray(empty), 0.0)


def test_rejects_what_it_does_not_cover():
    q = jnp.zeros((1, 4, 64), jnp.float32)
    pages = jnp.zeros((2, 16, 1, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="16-bit"):
        mosaic_decode_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0)
    q, pages = q.astype(jnp.bfloat16)[..., :48], pages.astype(jnp.bfloat16)[..., :48]
    with pytest.raises(NotImplementedError, match="head_dim 48"):
        mosaic_decode_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0)


def test_p_in_registers_is_refused_when_interpreted():
    """Mosaic GPU's interpret mode takes wgmma's A operand from shared memory only: asking for registers there is an
    error, not a silent change of route."""
    q, pages = jnp.zeros((1, 4, 64), jnp.bfloat16), jnp.zeros((2, 16, 1, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="p_in_registers"):
        mosaic_decode_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0,
                                p_in_registers=True, interpret=True)


def _decode_target_args() -> tuple:
    """The target shape of the decode benchmark (batch 64, 2k context, 8 KV heads, GQA 4, head 128), abstract."""
    seqs, kv_heads, group, head_dim, page, max_pages = 64, 8, 4, 128, 16, 128
    pool = jax.ShapeDtypeStruct((1 + seqs * max_pages, page, kv_heads, head_dim), jnp.bfloat16)
    return (jax.ShapeDtypeStruct((seqs, kv_heads * group, head_dim), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32), jax.ShapeDtypeStruct((seqs,), jnp.int32))


@pytest.mark.parametrize("slots", [2, 3])
def test_lowers_for_cuda_as_one_mosaic_gpu_kernel(slots):
    """Compiled, p reaches wgmma from registers and the output goes out through the q tile, so three 128-token
    K/V slots fit in Hopper's shared memory at head 128."""
    text = lower_for_cuda(functools.partial(mosaic_decode_attention, scale=128 ** -0.5, interpret=False, slots=slots),
                          *_decode_target_args()).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    assert len(calls) == 1


def test_split_keys_lower_for_cuda_as_one_mosaic_gpu_kernel():
    text = lower_for_cuda(functools.partial(mosaic_decode_attention, scale=128 ** -0.5, interpret=False, splits=4),
                          *_decode_target_args()).as_text()
    assert len([line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]) == 1


def test_shared_memory_bound_is_checked_when_lowering():
    """Four 128-token slots at head 128 (~274 KiB) exceed the 227 KiB a Hopper program may hold."""
    with pytest.raises(Exception, match="exceeds available shared memory"):
        lower_for_cuda(functools.partial(mosaic_decode_attention, scale=128 ** -0.5, interpret=False, slots=4),
                       *_decode_target_args())
