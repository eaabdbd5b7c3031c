"""Optimized HLO of the executables a runner runs for a StepCall (for checking collectives and buffers)."""
from __future__ import annotations

from typing import Any


def compiled_step_hlo(runner: Any, call: Any) -> dict[str, str]:
    """{'embed', 'layer', 'head': HLO text, and 'store_kv' when the backend stores K/V in an executable of its
    own}: the compiled pieces of the call's step shape."""
    step = runner.compiled.get(call.shape)
    texts = {"embed": step.embed.as_text(), "layer": step.layer.as_text(), "head": step.head.as_text(call.flags)}
    if hasattr(step.store_kv, "as_text"):
        texts["store_kv"] = step.store_kv.as_text()
    return texts
