"""benchmarks/gpu_quant_matmul.py and gpu_projections.py, the device stages' projection timings, run on tiny shapes
with the GPU image's versions (and on a GPU inside the device's test stage): every variant gives a record, within
its error."""
from __future__ import annotations

import argparse
import json


def test_tiny_run_records_every_variant(tmp_path):
    from benchmarks.gpu_quant_matmul import ROWS, VARIANTS, bench

    path = tmp_path / "records.json"
    records = bench(argparse.Namespace(tiny=True, json=str(path), budget_s=120.0))
    assert json.loads(path.read_text()) == records
    measured = {(r["variant"], r["rows"]) for r in records}
    assert {(v, m) for v in VARIANTS for m in ROWS[:2]} <= measured
    for record in records:
        assert record["us"] > 0 and record["bytes"] > 0
        if record["variant"] != "bf16":  # per-channel codes of random weights: within a few steps of their grid
            limit = 0.06 if record["variant"] == "fp8_channel" else 0.02
            assert record["rel_error_vs_bf16"] < limit


def test_tiny_projections_run_records_apart_and_joined(tmp_path):
    """benchmarks/gpu_projections.py: both ways of each group give a record; the joined product's values are the
    separate products'; XLA CPU joins no weights itself."""
    from benchmarks.gpu_projections import ROWS, bench

    path = tmp_path / "records.json"
    records = bench(argparse.Namespace(tiny=True, json=str(path), budget_s=120.0))
    assert json.loads(path.read_text()) == records
    assert {(r["weights"], r["rows"]) for r in records} == {(w, m) for w in ("apart", "joined") for m in ROWS[:2]}
    assert all(r["us"] > 0 for r in records)
    assert all(r["weights_concatenated"] is False for r in records if r["weights"] == "apart")
    assert all(r["rel_error_vs_apart"] < 1e-3 for r in records if r["weights"] == "joined")
