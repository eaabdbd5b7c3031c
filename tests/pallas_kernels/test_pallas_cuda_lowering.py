"""The backend's write_and_attend lowers for CUDA on a CPU-only machine: one Triton attention kernel, an XLA scatter
for the KV write, the pools donated. Kernel-level lowering tests: test_kernel_cuda_lowering.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from models.attention import AttentionMetadata
from jvllm.attention.pallas import write_and_attend
from pallas_kernels import common
from pallas_kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
from pallas_kernels.ragged_attention import ragged_block_q

# jax 0.11 warns that the Triton lowering of pallas_call is deprecated; that must not fail CI
pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

BF16, I32 = jnp.bfloat16, jnp.int32


def spec(*shape, dtype=I32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def pool(pages: int, page_size: int, kv_heads: int, head_dim: int) -> jax.ShapeDtypeStruct:
    return spec(pages, page_size, kv_heads, head_dim, dtype=BF16)


def metadata_spec(tokens: int, seqs: int, max_pages: int, decode: bool, block_q: int) -> AttentionMetadata:
    """A decode step (T == S) has no layout; a prefill step carries the ragged kernel's cdiv(T, block_q) + S
    work items."""
    items = spec(common.cdiv(tokens, block_q) + seqs)
    layout = {} if decode else {"item_seq": items, "item_first": items}
    return AttentionMetadata(spec(tokens), spec(seqs), spec(seqs), spec(seqs), spec(seqs, max_pages), layout,
                             decode)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("tokens,seqs", [(64, 64), (512, 16)], ids=["decode", "prefill"])
def test_write_and_attend_lowers_for_cuda_with_donated_pool(page_size, tokens, seqs):
    kv_heads, group, head_dim = 8, 4, 128
    decode = tokens == seqs
    fn = functools.partial(write_and_attend, scale=0.088, interpret=False)
    pages = pool(256, page_size, kv_heads, head_dim)
    block_q = ragged_block_q(BF16, BF16, kv_heads * group, kv_heads, head_dim)
    low = lower_for_cuda(
        fn, spec(tokens, kv_heads * group, head_dim, dtype=BF16), spec(tokens, kv_heads, head_dim, dtype=BF16),
        spec(tokens, kv_heads, head_dim, dtype=BF16), pages, pages,
        metadata_spec(tokens, seqs, 64, decode, block_q), donate_argnums=(3, 4))
    text = low.as_text()
    assert text.count(f"@{TRITON_CALL}(") == 1  # one attention kernel; the KV write is an XLA scatter
    kernel = "jvllm_decode_attention" if decode else "jvllm_ragged_paged_attention"
    assert kernel in text
    assert "stablehlo.scatter" in text
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text  # pools updated in place
