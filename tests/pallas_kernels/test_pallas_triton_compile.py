"""Each kernel variant's Triton IR compiles to an sm_90 cubin (triton's compiler and bundled ptxas, no GPU): no spills,
within an H100's registers and shared memory, and exactly as recorded in docs/pallas.md's resource table.

Needs the `triton` package (the GPU-versions leg, ci/gpu_versions_leg.sh, installs 3.6.0); without it the tests skip,
unless JVLLM_REQUIRE_TRITON=1 makes that a failure."""
from __future__ import annotations

import importlib.util
import os
import pathlib

import jax
import pytest

from pallas_kernels import ptx_resources, resource_table
from pallas_kernels.variants import Variant, compile_variants

pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pallas.md"


if importlib.util.find_spec("triton") is None:
    if os.environ.get("JVLLM_REQUIRE_TRITON") == "1":
        raise ImportError("JVLLM_REQUIRE_TRITON=1 but the `triton` package is not installed")
    pytest.skip("no `triton` package (ci/gpu_versions_leg.sh installs it)", allow_module_level=True)


def test_ptxas_report_parsing():
    report = ("ptxas info    : Function properties for k\n    368 bytes stack frame, 860 bytes spill stores, "
              "612 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers\n")
    assert ptx_resources.parse_ptxas_report(report) == (255, 368, 860, 612)
    with pytest.raises(ValueError):
        ptx_resources.parse_ptxas_report("ptxas info    : Compile time = 1 ms")


def test_ctas_per_sm_follow_the_tightest_limit():
    def ctas(registers: int, shared: int, warps: int) -> int:
        return ptx_resources.Resources(warps, 2, registers, 0, 0, 0, shared).ctas_per_sm

    assert ctas(123, 69632, 4) == 3  # shared memory: 3 x (68 + 1) KiB <= 228 KiB
    assert ctas(128, 0, 4) == 4  # registers: 4 warps x 4096 each of 65536
    assert ctas(227, 98304, 8) == 1  # 227 registers round up to 232 per thread: 7424 per warp, 8 warps fit
    assert ctas(16, 0, 1) == 32  # the CTA limit


@pytest.mark.parametrize("variant", compile_variants(), ids=lambda v: v.id)
def test_variant_fits_an_h100_without_spills(variant: Variant):
    res = resource_table.measure(variant)
    assert not res.spills, f"{res.stack_bytes} B stack, {res.spill_store_bytes} B spill stores"
    assert res.registers <= ptx_resources.MAX_REGISTERS
    assert res.shared_bytes <= ptx_resources.BLOCK_SHARED_LIMIT
    assert res.ctas_per_sm >= (2 if variant.kernel == "decode" and variant.dtype == "bfloat16" else 1)
    if jax.__version_info__[:3] == resource_table.TABLE_JAX_VERSION:  # the table records this jax's Triton IR
        recorded = resource_table.rows_in(DOC.read_text()).get(variant.id)
        assert recorded == resource_table.row(variant, res), "docs/pallas.md's resource table is out of date"
