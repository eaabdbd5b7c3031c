"""float32 dots in the lowered Triton IR are IEEE float32 (not TF32), and 16-bit dots accumulate in float32."""
from __future__ import annotations

import jax
import pytest

from pallas_kernels import common
from pallas_kernels.cuda_lowering import Dot, lower_for_cuda, triton_kernels
from pallas_kernels.variants import DTYPES, HEAD_DIMS, Variant

pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

VARIANTS = [Variant(kernel, hd, 16, dtype, 4) for kernel in ("decode", "ragged") for hd in HEAD_DIMS
            for dtype in DTYPES]


def element_types(dot: Dot) -> tuple[str, str, str]:
    return tuple(t.rsplit("x", 1)[1] for t in (dot.lhs, dot.rhs, dot.out))  # "16x128xbf16" -> "bf16"


def lowered_dots(variant: Variant) -> list[Dot]:
    fn, args = variant.call()
    [kernel] = triton_kernels(lower_for_cuda(fn, *args))
    return kernel.dots


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_dot_precision_in_the_triton_ir(variant: Variant):
    dots = lowered_dots(variant)
    assert len(dots) >= 2  # q @ k^T (one per head-dim chunk) and p @ v
    if variant.dtype == "float32":
        assert [element_types(d) for d in dots] == [("f32", "f32", "f32")] * len(dots)
        assert [d.precision for d in dots] == ["ieee"] * len(dots)
    else:
        assert [element_types(d) for d in dots] == [("bf16", "bf16", "f32")] * len(dots)


def test_default_precision_would_lower_to_tf32(monkeypatch):
    """The check above can fail: left at the default precision, the same float32 kernel's dots are TF32."""
    monkeypatch.setattr(common, "dot_precision", lambda dtype: jax.lax.Precision.DEFAULT)
    assert [d.precision for d in lowered_dots(Variant("decode", 128, 16, "float32", 4))] == ["tf32", "tf32"]
