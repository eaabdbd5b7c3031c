"""Registers, spills and shared memory of a kernel's Triton IR compiled for sm_90 by the `triton` wheel and its ptxas."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import tempfile

from pallas_kernels.cuda_lowering import TritonKernel

PTXAS_TIMEOUT_S = 300  # one kernel takes ptxas well under a second

# H100 (sm_90) per-SM limits, from the CUDA occupancy calculator's table for compute capability 9.0
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
BLOCK_SHARED_LIMIT = 227 * 1024  # the most dynamic shared memory one CTA may ask for
SHARED_RESERVED_PER_CTA = 1024  # the runtime keeps 1 KiB per resident CTA
SM_MAX_WARPS = 64
SM_MAX_CTAS = 32
REGISTER_UNIT = 256  # registers are handed to a warp in units of 256
MAX_REGISTERS = 255  # per thread; more than that spills


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel at its warps and stages, and the CTAs per SM that follow."""

    num_warps: int
    num_stages: int
    registers: int  # per thread
    stack_bytes: int  # local-memory stack frame per thread
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int  # dynamic shared memory per CTA (Triton's pipeline buffers and layout conversions)

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    @property
    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM: the tightest of registers, shared memory, warps and the CTA limit."""
        registers_per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = SM_REGISTERS // registers_per_warp // self.num_warps
        by_shared = SM_SHARED_BYTES // (self.shared_bytes + SHARED_RESERVED_PER_CTA)
        return min(by_registers, by_shared, SM_MAX_WARPS // self.num_warps, SM_MAX_CTAS)


def ptxas_path() -> pathlib.Path:
    """The ptxas (CUDA 12.8 in triton 3.6) shipped inside the `triton` wheel."""
    import triton

    return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def parse_ptxas_report(report: str) -> tuple[int, int, int, int]:
    """`ptxas -v` output for one entry function -> (registers, stack, spill stores, spill loads) in bytes."""
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    used = re.search(r"Used (\d+) registers", report)
    if frame is None or used is None:
        raise ValueError(f"no register report in ptxas output:\n{report}")
    stack, stores, loads = (int(x) for x in frame.groups())
    return int(used.group(1)), stack, stores, loads


def compile_for_sm90(kernel: TritonKernel, num_warps: int | None = None,
                     num_stages: int | None = None) -> Resources:
    """Compile the kernel's TTIR to PTX with triton's compiler for sm_90 (what XLA's bundled Triton does on an
    H100), then run the wheel's ptxas -v on the PTX for the register report. Warps and stages default to the
    kernel's own launch settings."""
    import triton
    from triton.backends.compiler import GPUTarget

    num_warps = kernel.num_warps if num_warps is None else num_warps
    num_stages = kernel.num_stages if num_stages is None else num_stages
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, f"{kernel.name}.ttir")
        pathlib.Path(source).write_text(kernel.ttir)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        ptx = os.path.join(folder, f"{kernel.name}.ptx")
        pathlib.Path(ptx).write_text(compiled.asm["ptx"])
        # a bound: a stalled ptxas fails its caller instead of holding it until the test's timeout ends the process
        done = subprocess.run([str(ptxas_path()), "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True, timeout=PTXAS_TIMEOUT_S)
    registers, stack, stores, loads = parse_ptxas_report(done.stdout + done.stderr)
    return Resources(num_warps, num_stages, registers, stack, stores, loads, compiled.metadata.shared)
