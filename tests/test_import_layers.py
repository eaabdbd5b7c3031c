"""The import contracts in pyproject.toml hold: layers run one way, the core has no JAX, no cycles upward."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept():
    command = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).with_name("lint-imports"))
    run = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") == 6, run.stdout[-2000:]
