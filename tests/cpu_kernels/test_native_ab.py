"""The two-build comparison (benchmarks.native_ab): other kernel sources built beside this checkout's and called in
the same process; built from the checkout's own sources, both builds give the same bits."""
from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import native_ab
from cpu_kernels.build import available


@pytest.mark.skipif(not available(), reason="the native CPU kernels cannot be built here")
def test_the_checkout_against_its_own_sources_gives_the_same_bits(tmp_path):
    out = tmp_path / "ab.json"
    checkout = pathlib.Path(native_ab.__file__).resolve().parent.parent
    assert native_ab.main(["--base", str(checkout), "--rows", "1", "--queries", "2", "--context", "40", "--reps", "2",
                           "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = [results["products"]["1"], results["attention"]["2x40"]]
    assert all(row["same_bits"] for row in rows)
    assert all(row["base_ms"] > 0 and row["new_ms"] > 0 for row in rows)


@pytest.mark.skipif(not available(), reason="the native CPU kernels cannot be built here")
def test_eight_bit_pages_against_the_base_s_bf16_ones(tmp_path):
    """`--new-pages fp8_e5m2`: this checkout's calls read 8-bit pages of the same values rounded (other bits, close
    outputs), the base's the bf16 pages."""
    out = tmp_path / "ab.json"
    checkout = pathlib.Path(native_ab.__file__).resolve().parent.parent
    assert native_ab.main(["--base", str(checkout), "--rows", "", "--queries", "1", "--context", "40", "--seqs", "3",
                           "--new-pages", "fp8_e5m2", "--reps", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    row = results["attention"]["3x1x40"]
    assert results["new_pages"] == "fp8_e5m2" and not row["same_bits"] and row["new_ms"] > 0
