"""The Mosaic GPU decode kernel against the jnp reference: interpret mode on CPU (jax >= 0.11, the GPU-versions leg),
compiled on a GPU; and its lowering for CUDA under an abstract H100 (one Mosaic GPU custom call)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU's interpret mode and plgpu.kernel "
                                "need jax >= 0.11: ci/gpu_versions_leg.sh runs these")

from pallas_kernels.cuda_lowering import lower_for_cuda  # noqa: E402
from pallas_kernels.mosaic_decode import mosaic_decode_attention  # noqa: E402
from pallas_kernels.reference import decode_attention_reference  # noqa: E402

TOLERANCE = {jnp.bfloat16: dict(rtol=2e-2, atol=2e-2), jnp.float16: dict(rtol=4e-3, atol=4e-3)}


def _pool(rng: np.random.Generator, num_pages: int, page: int, kv_heads: int, head_dim: int, dtype):
    shape = (num_pages, page, kv_heads, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kv_heads, group, head_dim, page, pages_per_block", [
    (2, 4, 64, 16, 2),  # GQA 4
    (1, 8, 128, 16, 1),  # GQA 8, head 128, one page a block
    (2, 1, 64, 32, 2),  # no GQA, 32-token pages
])
def test_matches_reference_over_uneven_lengths(dtype, kv_heads, group, head_dim, page, pages_per_block):
    rng = np.random.default_rng(kv_heads * 100 + group * 10 + page)
    seqs, max_pages = 5, 6
    num_pages = 1 + seqs * max_pages
    k_pages, v_pages = _pool(rng, num_pages, page, kv_heads, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((seqs, kv_heads * group, head_dim)), dtype)
    tables = jnp.asarray((1 + rng.permutation(seqs * max_pages)).reshape(seqs, max_pages), jnp.int32)
    block = page * pages_per_block
    # empty (a padding row), one key, a block boundary, one past it, the whole table
    lengths = jnp.asarray([0, 1, block, block + 1, max_pages * page], jnp.int32)
    scale = head_dim ** -0.5
    out = mosaic_decode_attention(q, k_pages, v_pages, tables, lengths, scale=scale, pages_per_block=pages_per_block)
    expected = decode_attention_reference(q, k_pages, v_pages, tables, lengths, scale=scale)
    got, want = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert out.shape == q.shape and out.dtype == q.dtype and np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], 0.0)  # a padding row attends to nothing
    np.testing.assert_allclose(got[1:], want[1:], **TOLERANCE[dtype])
    # one key: the output is that key's value row for every query head of its KV head
    first_v = np.asarray(v_pages[int(tables[1, 0]), 0], np.float32)  # [KVH, hd]
    np.testing.assert_allclose(got[1].reshape(kv_heads, group, head_dim), np.repeat(first_v[:, None], group, 1),
                               **TOLERANCE[dtype])


def test_rejects_what_it_does_not_cover():
    q = jnp.zeros((1, 4, 64), jnp.float32)
    pages = jnp.zeros((2, 16, 1, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="16-bit"):
        mosaic_decode_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0)
    q, pages = q.astype(jnp.bfloat16)[..., :48], pages.astype(jnp.bfloat16)[..., :48]
    with pytest.raises(NotImplementedError, match="head_dim 48"):
        mosaic_decode_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0)


def test_lowers_for_cuda_as_one_mosaic_gpu_kernel():
    """The target shape of the decode benchmark (batch 64, 2k context, 8 KV heads, GQA 4, head 128)."""
    seqs, kv_heads, group, head_dim, page, max_pages = 64, 8, 4, 128, 16, 128
    pool = jax.ShapeDtypeStruct((1 + seqs * max_pages, page, kv_heads, head_dim), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((seqs, kv_heads * group, head_dim), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32), jax.ShapeDtypeStruct((seqs,), jnp.int32))
    text = lower_for_cuda(functools.partial(mosaic_decode_attention, scale=head_dim ** -0.5, interpret=False),
                          *args).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    assert len(calls) == 1
