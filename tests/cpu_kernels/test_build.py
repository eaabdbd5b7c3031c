"""The kernels' build: sources compiled side by side into one library, and a failed compile reported with the
compiler's message."""
from __future__ import annotations

import ctypes
import logging
import pathlib

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
