"""Builds the native CPU kernels once per machine (g++, jaxlib's XLA FFI headers) and registers them with XLA.

The shared library is cached under `$JVLLM_CACHE_DIR/cpu_kernels` (default `~/.cache/jvllm/cpu_kernels`), keyed
by the source, the jaxlib version, the compiler and the CPU's instruction-set flags (it is built with
`-march=native`). Without a C++ compiler, or with `JVLLM_CPU_KERNELS=0`, the kernels are unavailable and `load()`
says why."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import time
from typing import Any

try:
    import fcntl
except ImportError:  # no POSIX file locks (Windows): processes starting together would each build
    fcntl = None

logger = logging.getLogger("jvllm.cpu_kernels")
SWITCH = "JVLLM_CPU_KERNELS"  # 0 turns the kernels off

HERE = pathlib.Path(__file__).parent
# Longest to compile first (seconds on the 2-core Zen 5 VM, each alone), so that the build does not end with one
# long unit left alone on a core: the block formats' products ~8-15 s a unit, the attention ~6, the rest 2-3.
SOURCES = [HERE / name for name in ("kquant_products.cc", "word_group_format_products.cc", "blocks32_products.cc",
                                    "interleaved_format_products.cc", "q6k_products.cc", "paged_attention.cc",
                                    "bf16_rows.cc", "bf16_weight_tiles.cc", "quantized_matmul.cc", "rms_norm.cc",
                                    "rope.cc", "row_argmax.cc", "encoder.cc")]
HEADERS = sorted(HERE.glob("*.h"))
TARGETS = {  # XLA custom-call name -> exported handler symbol
    "jvllm_paged_attention": "JvllmPagedAttention",
    "jvllm_paged_attention_write": "JvllmPagedAttentionWrite",
    "jvllm_quantized_matmul": "JvllmQuantizedMatmul",
    "jvllm_gated_matmul": "JvllmGatedMatmul",
    "jvllm_rms_norm": "JvllmRmsNorm",
    "jvllm_add_rms_norm": "JvllmAddRmsNorm",
    "jvllm_rope_qkv": "JvllmRopeQkv",
    "jvllm_row_argmax": "JvllmRowArgmax",
    "jvllm_bf16_rows": "JvllmBf16Rows",
    "jvllm_bf16_tiles": "JvllmBf16Tiles",
    "jvllm_segment_attention": "JvllmSegmentAttention",
}
# -fno-gnu-unique: another build of the kernels (benchmarks.native_ab) can be loaded beside this one in one process
# with its own copies of inline functions' statics
FLAGS = ["-std=c++17", "-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-fno-gnu-unique"]


class KernelsUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("JVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jvllm")
    return pathlib.Path(root) / "cpu_kernels"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise KernelsUnavailable("no C++ compiler found (install g++ or set CXX)")
    return compiler


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_has_bf16_dots() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX-512 BF16's `vdpbf16ps`), which make bf16 matrix products
    faster than float32 ones (known without building the kernels)."""
    return "avx512_bf16" in _cpu_flags().split()


def _library_path(compiler: str) -> pathlib.Path:
    import jaxlib

    key = hashlib.sha256()
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    for part in (*sources, jaxlib.__version__.encode(), compiler.encode(), " ".join(FLAGS).encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"jvllm_cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: pathlib.Path) -> None:
    """Compiles the sources side by side, each in its own compiler process, as many at once as there are CPUs to run
    them (each takes ~0.5 GB), in SOURCES' order, then links them."""
    import jax.ffi

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [pathlib.Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        _run_compiles([[compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", str(obj)]
                       for source, obj in zip(SOURCES, objects)], _usable_cpus())
        partial = pathlib.Path(tmp) / target.name
        link = [compiler, *FLAGS, "-shared", *map(str, objects), "-o", str(partial)]
        result = subprocess.run(link, capture_output=True, text=True)
        _check(link, result.returncode, result.stderr)
        os.replace(partial, target)  # atomic: concurrent builders each finish a whole file


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def _run_compiles(commands: list[list[str]], parallel: int) -> None:
    """Runs `commands` in order, at most `parallel` at once; the first that fails raises (the others are stopped)."""
    pending = list(commands)
    running: list[tuple[list[str], subprocess.Popen, Any]] = []  # (command, process, its stderr file)
    try:
        while pending or running:
            while pending and len(running) < parallel:
                command = pending.pop(0)
                errors = tempfile.TemporaryFile(mode="w+")
                running.append((command, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors,
                                                          text=True), errors))
            finished = [item for item in running if item[1].poll() is not None]
            if not finished:
                time.sleep(0.05)
                continue
            for item in finished:
                running.remove(item)
                command, process, errors = item
                errors.seek(0)
                message = errors.read()
                errors.close()
                _check(command, process.returncode, message)
    finally:  # after a failure, the compiles still running are stopped
        for _, process, errors in running:
            if process.poll() is None:
                process.kill()
            process.wait()
            errors.close()


def _check(command: list[str], returncode: int, stderr: str) -> None:
    if returncode != 0:
        raise KernelsUnavailable(f"building the CPU kernels failed:\n{' '.join(command)}\n{stderr[-4000:]}")


def built_library(compiler: str) -> pathlib.Path:
    """The shared library for this machine, built first (and logged: it takes a while) if the cache lacks it."""
    path = _library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per library (processes started together, e.g. test workers, would otherwise each run
    # the whole build on the same cores); the others wait, then find the file.
    with open(path.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            logger.info("building the native CPU kernels for this CPU into %s (first start only: ~40 s on 2 cores)",
                        path.parent)
            started = time.perf_counter()
            _build(compiler, path)
            logger.info("native CPU kernels built in %.1fs", time.perf_counter() - started)
    return path


def unsupported_cpu() -> str | None:
    """Why the kernels do not run on this CPU, or None where they do. Their vector paths are written for x86-64
    with AVX2 and FMA; elsewhere only their plain loops would remain, which run the embedded model ~15x slower than
    XLA's own kernels (docs/design/cpu_profiles.md, "CPUs without AVX2")."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they need an x86-64 CPU with AVX2 (this is {platform.machine() or 'an unknown machine'})"
    missing = [flag for flag in ("avx2", "fma") if flag not in _cpu_flags().split()]
    if missing:
        return f"they need AVX2 and FMA (this CPU lacks {' and '.join(missing)})"
    return None


def turned_off() -> str | None:
    """Why the kernels are off on request (`JVLLM_CPU_KERNELS=0`: XLA's kernels everywhere, no build), or None."""
    value = os.environ.get(SWITCH, "").strip()
    if value.lower() in ("0", "false", "no", "off"):
        return f"turned off by {SWITCH}={value}"
    return None


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernels' shared library, built if needed, with its custom calls registered for XLA CPU."""
    import jax.ffi

    reason = turned_off() or unsupported_cpu()
    if reason:
        raise KernelsUnavailable(f"native CPU kernels not used: {reason}")
    library = ctypes.CDLL(str(built_library(_compiler())))
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return library


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the native kernels are built (or can be) and registered. Asked once per process: a failed build is
    not retried (each try compiles for seconds to a minute), and its reason is logged once."""
    try:
        load()
    except (KernelsUnavailable, OSError) as error:
        log = logger.info if turned_off() or unsupported_cpu() else logger.warning
        log("%s; the engine runs on XLA's kernels instead", error)
        return False
    return True
