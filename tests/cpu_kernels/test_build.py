"""The kernels' build: sources compiled side by side into one library, and a failed compile reported with the
compiler's message."""
from __future__ import annotations

import ctypes
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
