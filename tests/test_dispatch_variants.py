"""benchmarks.dispatch_variants: each variant's environment, and names it does not know refused before any run."""
from __future__ import annotations

import pytest

from benchmarks import dispatch_variants
from benchmarks.dispatch_variants import ANY_SIZE_GRAPHS, VARIANTS, variant_env


def test_a_variant_adds_its_xla_flags_to_those_set(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=512")
    monkeypatch.delenv("JVLLM_LAYERS_PER_CALL", raising=False)
    env = variant_env(VARIANTS["8 layers a call, graphs of any size"])
    assert env["XLA_FLAGS"] == f"--xla_cpu_prefer_vector_width=512 {ANY_SIZE_GRAPHS}"
    assert env["JVLLM_LAYERS_PER_CALL"] == "8"
    assert "JVLLM_LAYERS_PER_CALL" not in variant_env(VARIANTS["one layer a call"])


def test_unknown_variants_are_refused_before_running(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(dispatch_variants, "run_variant", lambda *args: ran.append(args))
    with pytest.raises(SystemExit):
        dispatch_variants.main(["--variants", "one layer a call,every layer twice"])
    assert "every layer twice" in capsys.readouterr().err and not ran
