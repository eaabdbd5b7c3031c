"""Every kernel variant the engine can launch lowers through Triton for CUDA on a CPU-only machine (jax 0.10.2, 0.12)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import common, launch
from pallas_kernels.cuda_lowering import TRITON_CALL, lower_for_cuda, triton_kernels
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.ragged_attention import ragged_block_q, ragged_paged_attention
from pallas_kernels.variants import (DECODE_SEQS, KERNEL_NAMES, KV_HEADS, PREFILL_SEQS, PREFILL_TOKENS, Variant,
                                     all_variants)

# jax 0.11 warns that the Triton lowering of pallas_call is deprecated; that must not fail CI
pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

BF16, I32 = jnp.bfloat16, jnp.int32


def spec(*shape: int, dtype=I32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def ragged_item_specs(tokens: int, seqs: int, q_dtype, kv_dtype, heads: int = 8, kv_heads: int = 2,
                      head_dim: int = 128) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """(item_seq, item_first) specs of a ragged call at its default block_q: cdiv(T, block_q) + S items."""
    block_q = ragged_block_q(q_dtype, kv_dtype, heads, kv_heads, head_dim)
    items = spec(common.cdiv(tokens, block_q) + seqs)
    return items, items


def element_type(tensor_type: str) -> str:
    return tensor_type.rsplit("x", 1)[1]  # "16x128xbf16" -> "bf16"


def expected_launch(variant: Variant) -> launch.Launch:
    if variant.kernel == "decode":
        return launch.decode_launch(variant.dtype, variant.dtype, variant.head_dim)
    return launch.ragged_launch(variant.dtype, variant.dtype, variant.head_dim)


def expected_dot_shapes(variant: Variant) -> list[str]:
    """Result shapes "RxNxf32" of the q @ k^T dots (one per head-dim chunk) and of p @ v: R query rows per
    program, N keys per block."""
    defaults = expected_launch(variant)
    group_rows = common.next_pow2(variant.group)
    if variant.kernel == "decode":
        rows = max(16, group_rows)
    else:
        rows = group_rows * max(defaults.block_rows // group_rows, 16 // group_rows)
    keys = max(defaults.block_tokens, variant.page_size)
    return [f"{rows}x{keys}xf32"] * defaults.qk_chunks + [f"{rows}x{variant.head_dim}xf32"]


def expected_programs(variant: Variant) -> int:
    """The grid's first axis: one program per decode sequence; per ragged work item, cdiv(T, block_q) + S."""
    if variant.kernel == "decode":
        return DECODE_SEQS
    block_q = ragged_block_q(variant.dtype, variant.dtype, KV_HEADS * variant.group, KV_HEADS, variant.head_dim)
    return common.cdiv(PREFILL_TOKENS, block_q) + PREFILL_SEQS


@pytest.mark.parametrize("variant", all_variants(), ids=lambda v: v.id)
def test_variant_lowers_to_its_triton_kernel(variant):
    fn, args = variant.call()
    lowered = lower_for_cuda(fn, *args)
    kernels = triton_kernels(lowered)
    calls = 2 if variant.kernel == "kv_write" else 1  # the KV write stores K and V with one call each
    assert lowered.as_text().count(f"@{TRITON_CALL}(") == calls
    assert [k.name for k in kernels] == [KERNEL_NAMES[variant.kernel]] * calls
    kernel = kernels[0]
    if variant.kernel == "kv_write":
        assert (kernel.num_warps, kernel.num_stages, kernel.dots) == (1, 1, [])
        assert kernel.grid == (PREFILL_TOKENS, KV_HEADS, 1)
        return
    defaults = expected_launch(variant)
    assert (kernel.num_warps, kernel.num_stages) == (defaults.num_warps, defaults.num_stages)
    assert kernel.grid[:2] == (expected_programs(variant), KV_HEADS)
    assert [dot.out for dot in kernel.dots] == expected_dot_shapes(variant)


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_float32_queries_over_a_bfloat16_pool_lower_for_cuda(kernel):
    pages = spec(64, 16, 2, 128, dtype=BF16)
    if kernel == "decode":
        fn = functools.partial(decode_attention, scale=0.088, interpret=False)
        args = (spec(8, 8, 128, dtype=jnp.float32), pages, pages, spec(8, 16), spec(8))
        defaults = launch.decode_launch(jnp.float32, BF16, 128)
    else:
        fn = functools.partial(ragged_paged_attention, scale=0.088, interpret=False)
        args = (spec(64, 8, 128, dtype=jnp.float32), pages, pages, spec(4), spec(4), spec(4), spec(4, 16),
                *ragged_item_specs(64, 4, jnp.float32, BF16))
        defaults = launch.ragged_launch(jnp.float32, BF16, 128)
    [lowered] = triton_kernels(lower_for_cuda(fn, *args))
    # keys are widened to the queries' float32 (one q @ k^T dot per head-dim chunk), probabilities narrowed to
    # the values' bfloat16; the float32 launch settings apply
    qk_chunks = defaults.qk_chunks if kernel == "ragged" else 1
    assert [tuple(element_type(t) for t in (d.lhs, d.rhs, d.out)) for d in lowered.dots] == [
        ("f32", "f32", "f32")] * qk_chunks + [("bf16", "bf16", "f32")]
    assert (lowered.num_warps, lowered.num_stages) == (defaults.num_warps, defaults.num_stages)
    assert defaults.num_stages == 1  # the float32 entries run unpipelined


@pytest.mark.parametrize("dtype", [BF16, jnp.float32], ids=["bf16", "f32"])
def test_soft_cap_lowers_for_cuda(dtype):
    """Soft capping is a kernel option the engine does not pass (so no variant above): it still lowers."""
    pages = spec(64, 16, 2, 128, dtype=dtype)
    decode = functools.partial(decode_attention, scale=0.088, soft_cap=30.0, interpret=False)
    ragged = functools.partial(ragged_paged_attention, scale=0.088, soft_cap=30.0, interpret=False)
    [decode_kernel] = triton_kernels(lower_for_cuda(decode, spec(8, 8, 128, dtype=dtype), pages, pages,
                                                    spec(8, 16), spec(8)))
    [ragged_kernel] = triton_kernels(lower_for_cuda(ragged, spec(64, 8, 128, dtype=dtype), pages, pages, spec(4),
                                                    spec(4), spec(4), spec(4, 16),
                                                    *ragged_item_specs(64, 4, dtype, dtype)))
    assert "tanh" in decode_kernel.ttir and "tanh" in ragged_kernel.ttir


def test_lowering_really_runs_triton_checks(monkeypatch):
    """With the wrapper's own power-of-two check switched off, a head_dim of 96 still fails: in the Triton
    lowering itself, so these tests exercise it rather than only tracing."""
    monkeypatch.setattr(common, "check_pow2", lambda **sizes: None)
    fn = functools.partial(decode_attention, scale=0.1, interpret=False)
    pages = spec(32, 16, 8, 96, dtype=BF16)
    with pytest.raises(Exception, match="power of 2"):
        lower_for_cuda(fn, spec(4, 32, 96, dtype=BF16), pages, pages, spec(4, 8), spec(4))


@pytest.mark.parametrize("bad", [dict(page_size=24), dict(head_dim=96)])
def test_non_power_of_two_blocks_are_rejected_early(bad):
    page_size, head_dim = bad.get("page_size", 16), bad.get("head_dim", 128)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(jnp.zeros((2, 8, head_dim), BF16), jnp.zeros((4, page_size, 2, head_dim), BF16),
                         jnp.zeros((4, page_size, 2, head_dim), BF16), jnp.zeros((2, 2), I32), jnp.ones(2, I32),
                         scale=0.1, interpret=False)
    with pytest.raises(ValueError, match="power of two"):
        ragged_paged_attention(jnp.zeros((8, 8, head_dim), BF16), jnp.zeros((4, page_size, 2, head_dim), BF16),
                               jnp.zeros((4, page_size, 2, head_dim), BF16), jnp.zeros(2, I32), jnp.ones(2, I32),
                               jnp.ones(2, I32), jnp.zeros((2, 2), I32), jnp.zeros(3, I32), jnp.zeros(3, I32),
                               scale=0.1, interpret=False)
