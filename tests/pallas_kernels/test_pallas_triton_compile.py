"""Optional: the kernels' Triton IR compiles to PTX and a cubin for sm_90 with the `triton` package, no GPU needed.

Runs when `triton` imports here, or when JVLLM_TRITON_PYTHON names an interpreter that has it (triton is ~1 GB,
so it is not a test dependency). Catches what jaxlib's lowering lets through: tl.dot tile limits, layouts,
shared memory that does not fit."""
from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv_kernel
from pallas_kernels.ragged_attention import ragged_paged_attention

pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

H100_SHARED_BYTES = 227 * 1024  # dynamic shared memory one block may use on sm_90

COMPILE_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
results = {}
for name, path, num_warps, num_stages in json.loads(sys.argv[1]):
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    results[name] = {"shared": kernel.metadata.shared, "cubin": len(kernel.asm["cubin"])}
print(json.dumps(results))
"""


def triton_python() -> str | None:
    if os.environ.get("JVLLM_TRITON_PYTHON"):
        return os.environ["JVLLM_TRITON_PYTHON"]
    return sys.executable if importlib.util.find_spec("triton") else None


def capture_ttir(fn, *args) -> str:
    """Textual Triton IR of the single pallas_call in `fn`, from jaxlib's Triton lowering (private API)."""
    from jax._src.pallas.triton import lowering

    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def spy(*a, **k):
        captured.append(original(*a, **k))
        return captured[-1]

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    [result] = captured
    return result.module.operation.get_asm(enable_debug_info=False)


def warps_and_stages(fn) -> tuple[int, int]:
    params = inspect.signature(fn).parameters
    return params["num_warps"].default, params["num_stages"].default


def spec(*shape, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def kernels_to_compile() -> dict[str, tuple]:
    bf16 = jnp.bfloat16
    out = {}
    for page_size, head_dim, kv_heads, group in [(16, 128, 8, 4), (32, 128, 4, 8), (16, 64, 4, 1), (32, 128, 2, 3)]:
        pages = spec(512, page_size, kv_heads, head_dim, dtype=bf16)
        decode = functools.partial(decode_attention, scale=0.088, sliding_window=4096, interpret=False)
        out[f"decode-p{page_size}-hd{head_dim}-g{group}"] = (
            decode, warps_and_stages(decode_attention),
            (spec(64, kv_heads * group, head_dim, dtype=bf16), pages, pages, spec(64, 128), spec(64)))
        ragged = functools.partial(ragged_paged_attention, max_q_len=512, scale=0.088, soft_cap=50.0,
                                   interpret=False)
        out[f"ragged-p{page_size}-hd{head_dim}-g{group}"] = (
            ragged, warps_and_stages(ragged_paged_attention),
            (spec(512, kv_heads * group, head_dim, dtype=bf16), pages, pages, spec(8), spec(8), spec(8),
             spec(8, 64)))
    pages = spec(64, 16, 8, 128, dtype=bf16)
    out["kv-write"] = (functools.partial(write_kv_kernel, interpret=False), (1, 1),
                       (pages, spec(256, 8, 128, dtype=bf16), spec(256)))
    return out


def test_kernels_compile_to_cubin_for_sm90(tmp_path):
    python = triton_python()
    if python is None:
        pytest.skip("no `triton` package (pip install triton, or set JVLLM_TRITON_PYTHON)")
    jobs = []
    for name, (fn, (num_warps, num_stages), args) in kernels_to_compile().items():
        path = tmp_path / f"{name}.ttir"
        path.write_text(capture_ttir(fn, *args))
        jobs.append((name, str(path), num_warps, num_stages))
    done = subprocess.run([python, "-c", COMPILE_SCRIPT, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {name for name, *_ in jobs}
    for name, info in results.items():
        assert info["cubin"] > 0, name
        assert info["shared"] <= H100_SHARED_BYTES, f"{name} needs {info['shared']} bytes of shared memory"
