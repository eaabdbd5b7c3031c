"""The grouped-matmul kernel (mixture-of-experts rows sorted by expert) against jax.lax.ragged_dot in interpret mode,
its work-item walk, and its lowering for CUDA (plus ptxas's register report where the `triton` wheel is present)."""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ptx_resources
from pallas_kernels.cuda_lowering import lower_for_cuda, triton_kernels
from pallas_kernels.grouped_matmul import grouped_matmul, work_items

pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

# (group sizes, rows): empty groups, groups straddling 16-row tiles, one group filling a tile exactly, rows past
# the groups' sum (ragged_dot leaves them zero), a single row
GROUPINGS = [([5, 0, 20, 7], 32), ([0, 0, 3, 0], 3), ([16, 16], 40), ([1, 2, 3, 4, 5, 6, 7, 8], 36), ([0, 1], 1),
             ([30, 0, 0, 34], 64)]


def _reference(lhs, rhs, sizes):
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("sizes, rows", GROUPINGS)
@pytest.mark.parametrize("dtype, k, n", [(jnp.float32, 64, 32), (jnp.bfloat16, 128, 96)])
def test_matches_ragged_dot(sizes, rows, dtype, k, n):
    rng = np.random.default_rng(len(sizes) * rows)
    lhs = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(lhs, rhs, group_sizes, interpret=True)
    want = _reference(lhs, rhs, group_sizes)
    assert got.shape == want.shape == (rows, n) and got.dtype == jnp.float32
    tolerance = 1e-4 if dtype == jnp.float32 else 1e-2 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tolerance)
    assert not np.any(np.asarray(got)[sum(sizes):]), "rows past the groups must be zero"


def test_work_items_cover_each_group_tile_once():
    item_group, item_tile, count = work_items(jnp.asarray([5, 0, 20, 7]), num_row_tiles=2, block_m=16)
    count = int(count)
    pairs = list(zip(np.asarray(item_group)[:count].tolist(), np.asarray(item_tile)[:count].tolist()))
    # rows 0-4 group 0 (tile 0), 5-24 group 2 (tiles 0, 1), 25-31 group 3 (tile 1); group 1 is empty
    assert pairs == [(0, 0), (2, 0), (2, 1), (3, 1)]
    assert item_group.shape == (2 + 4 - 1,)


def test_sizes_that_tl_dot_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_matmul(jnp.zeros((4, 24)), jnp.zeros((2, 24, 32)), jnp.asarray([2, 2]), interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lowers_for_cuda_with_one_kernel_and_full_precision_dots(dtype):
    """A Qwen3-30B-A3B-shaped expert projection: 256 token choices, 128 experts, 2048 -> 768."""
    lowered = lower_for_cuda(lambda a, b, s: grouped_matmul(a, b, s, interpret=False),
                             jax.ShapeDtypeStruct((256, 2048), dtype), jax.ShapeDtypeStruct((128, 2048, 768), dtype),
                             jax.ShapeDtypeStruct((128,), jnp.int32))
    kernels = triton_kernels(lowered)
    assert [k.name for k in kernels] == ["jvllm_grouped_matmul"]
    (kernel,) = kernels
    assert kernel.grid[:2] == (256 // 16 + 128 - 1, 768 // 64)
    assert kernel.dots
    if dtype == "float32":  # full float32 products, not TF32
        assert all(d.precision == "ieee" for d in kernel.dots), kernel.dots
    assert all(d.out.startswith("16x64x") for d in kernel.dots)
    if importlib.util.find_spec("triton") is not None:  # the GPU-versions leg: ptxas's report on sm_90
        resources = ptx_resources.compile_for_sm90(kernel)
        assert not resources.spills, resources
        assert resources.registers <= ptx_resources.MAX_REGISTERS
        assert resources.shared_bytes <= ptx_resources.BLOCK_SHARED_LIMIT
