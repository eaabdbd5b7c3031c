"""benchmarks/gpu_quant_matmul.py, the device stage's projection timings, runs on tiny shapes with the GPU image's
versions (and on a GPU inside the device's test stage): every variant gives a record, within its format's error."""
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
