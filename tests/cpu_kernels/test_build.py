"""The kernels' build: sources compiled side by side into one library, and a failed compile reported with the
compiler's message."""
from __future__ import annotations

import ctypes
import logging
import pathlib
import re

import pytest

from cpu_kernels import build


def _write(folder: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = folder / name
    path.write_text(text)
    return path


def test_sources_compiled_apart_link_into_one_library(tmp_path, monkeypatch):
    sources = [_write(tmp_path, "one.cc", 'extern "C" int JvllmOne() { return 1; }\n'),
               _write(tmp_path, "two.cc", 'extern "C" int JvllmTwo() { return 2; }\n')]
    monkeypatch.setattr(build, "SOURCES", sources)
    target = tmp_path / "out" / "kernels.so"
    build._build(build._compiler(), target)
    library = ctypes.CDLL(str(target))
    assert (library.JvllmOne(), library.JvllmTwo()) == (1, 2)


def test_a_failed_compile_names_the_command_and_the_compilers_message(tmp_path, monkeypatch):
    sources = [_write(tmp_path, "fine.cc", 'extern "C" int JvllmFine() { return 0; }\n'),
               _write(tmp_path, "broken.cc", "int broken( { return 0; }\n")]
    monkeypatch.setattr(build, "SOURCES", sources)
    target = tmp_path / "out" / "kernels.so"
    with pytest.raises(build.KernelsUnavailable, match=r"(?s)building the CPU kernels failed:.*broken\.cc.*error"):
        build._build(build._compiler(), target)
    assert not target.exists()  # nothing half-built is left where load() looks


def test_a_build_says_what_it_does_and_how_long_it_took(tmp_path, monkeypatch, caplog):
    """The first start compiles for ~30 s: it logs that it builds, where, and its time; a built library is reused
    without a word."""
    monkeypatch.setattr(build, "SOURCES", [_write(tmp_path, "one.cc", 'extern "C" int JvllmOne() { return 1; }\n')])
    monkeypatch.setenv("JVLLM_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="jvllm.cpu_kernels"):
        path = build.built_library(build._compiler())
        built = [r.getMessage() for r in caplog.records]
        caplog.clear()
        assert build.built_library(build._compiler()) == path
    assert ctypes.CDLL(str(path)).JvllmOne() == 1
    assert "building the native CPU kernels" in built[0] and str(tmp_path / "cache") in built[0]
    assert built[1].startswith("native CPU kernels built in ")
    assert not caplog.records


def test_builders_starting_together_build_once(tmp_path, monkeypatch):
    """Two processes (here: threads, each with its own lock file handle) that need the library at once: one builds,
    the other waits for it and finds the file."""
    import threading
    import time

    monkeypatch.setattr(build, "SOURCES", [_write(tmp_path, "one.cc", 'extern "C" int JvllmOne() { return 1; }\n')])
    monkeypatch.setenv("JVLLM_CACHE_DIR", str(tmp_path / "cache"))
    real_build, builds = build._build, []

    def slow_build(compiler: str, target: pathlib.Path) -> None:
        builds.append(target)
        time.sleep(0.5)  # long enough for the other thread to arrive while this one builds
        real_build(compiler, target)

    monkeypatch.setattr(build, "_build", slow_build)
    paths: list[pathlib.Path] = []
    threads = [threading.Thread(target=lambda: paths.append(build.built_library(build._compiler())))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and paths[0] == paths[1] == builds[0]
    assert ctypes.CDLL(str(paths[0])).JvllmOne() == 1


def test_compiles_run_at_most_as_many_at_once_as_asked(tmp_path):
    """Each command holds a lock directory for a moment and fails if another holds it: one at a time, none fails;
    three at once, the build stops with the compiler-style error."""
    lock = tmp_path / "lock"
    command = ["sh", "-c", f"mkdir {lock} || {{ echo busy >&2; exit 1; }}; sleep 0.2; rmdir {lock}"]
    build._run_compiles([command] * 3, parallel=1)
    with pytest.raises(build.KernelsUnavailable, match="busy"):
        build._run_compiles([command] * 3, parallel=3)


@pytest.mark.parametrize("machine, flags, lacking", [("aarch64", "fp asimd", "x86-64 CPU with AVX2 (this is aarch64)"),
                                                     ("x86_64", "fpu sse4_2 avx", "lacks avx2 and fma")])
def test_a_cpu_without_avx2_builds_nothing_and_says_why(monkeypatch, machine, flags, lacking):
    """The kernels' vector paths need x86-64 with AVX2 and FMA; their plain loops alone run far slower than XLA's
    kernels, so such CPUs keep XLA's and spend no start-up compiling."""
    monkeypatch.setattr(build.platform, "machine", lambda: machine)
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(build, "_build", lambda *args: pytest.fail("compiled for a CPU the kernels do not run on"))
    assert lacking in build.unsupported_cpu()
    with pytest.raises(build.KernelsUnavailable, match=f"native CPU kernels not used: .*{re.escape(lacking)}"):
        build.load.__wrapped__()



@pytest.mark.parametrize("value", ["0", "off"])
def test_the_switch_turns_the_kernels_off_without_building(monkeypatch, caplog, value):
    """JVLLM_CPU_KERNELS=0 keeps XLA's kernels everywhere (a CI leg that tests other kernels, a user ruling the native
    ones out): nothing is compiled, and the engine is told so at the info level, not as a failure."""
    monkeypatch.setenv("JVLLM_CPU_KERNELS", value)
    monkeypatch.setattr(build, "_build", lambda *args: pytest.fail("compiled although turned off"))
    with pytest.raises(build.KernelsUnavailable, match=f"turned off by JVLLM_CPU_KERNELS={value}"):
        build.load.__wrapped__()
    monkeypatch.setattr(build, "load", build.load.__wrapped__)
    build.available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="jvllm.cpu_kernels"):
            assert build.available() is False
    finally:
        build.available.cache_clear()
    [record] = caplog.records
    assert record.levelno == logging.INFO and "XLA's kernels instead" in record.getMessage()
    monkeypatch.setenv("JVLLM_CPU_KERNELS", "1")
    assert build.turned_off() is None

def test_kernels_that_cannot_load_are_tried_once_a_process(monkeypatch, caplog):
    """A failed build is not retried by each caller that asks (every try would compile again), and its reason is
    logged once, as a warning where a compiler failed on a CPU the kernels support."""
    tries = []

    def failing_load() -> None:
        tries.append(1)
        raise build.KernelsUnavailable("building the CPU kernels failed: (the compiler's message)")

    monkeypatch.setattr(build, "load", failing_load)
    build.available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="jvllm.cpu_kernels"):
            assert build.available() is False and build.available() is False
    finally:
        build.available.cache_clear()  # the next caller asks the real library again
    assert len(tries) == 1
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "the compiler's message" in record.getMessage()
    assert "XLA's kernels instead" in record.getMessage()
