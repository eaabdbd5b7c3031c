"""benchmarks.host_loop: every phase it times is a callable the engine's step runs, and the figures add up."""
from __future__ import annotations

import json
import sys

import pytest

import jvllm.engine.step_plan
from benchmarks import host_loop


def test_host_loop_times_every_phase_of_a_step(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "host_loop.json"
    monkeypatch.setattr(sys, "argv", ["host_loop", "--rows", "3", "--layers", "2", "--output-len", "6",
                                      "--repeats", "1", "--no-precompile", "--json", str(out)])
    plan_chunks = jvllm.engine.step_plan.plan_chunks
    host_loop.main()
    assert jvllm.engine.step_plan.plan_chunks is plan_chunks  # the timed callables are put back
    [result] = json.loads(out.read_text())["results"]
    phases = result["phases_ms_per_step"]
    assert set(phases) == {phase for _, _, phase in host_loop.PHASES}  # each wrapped callable ran
    assert all(ms > 0 for ms in phases.values())
    assert result["compiles_in_timed_passes"] == 0  # the warm-up pass met every shape
    assert 0 < result["main_thread_cpu_ms_per_step"] <= result["wall_ms_per_step"] * 1.05
    assert phases["run_call: send + dispatch every jitted piece"] <= result["main_thread_cpu_ms_per_step"]
