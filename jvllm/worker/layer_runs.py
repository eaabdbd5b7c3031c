"""How a step's layers are split into runs of consecutive layers, each run one executable call.

Each call of a compiled piece costs the host a fixed amount of work (arguments, the runtime's bookkeeping, on a GPU
the launch of each kernel), so a step of L layers called one layer at a time pays it L times. A run of n layers in
one executable pays it L / n times; its compile takes about n times one layer's. JVLLM_LAYERS_PER_CALL sets n for
decode steps and the prefill steps that take their runs. By default a CPU engine runs all of a step's layers in one call, prefill steps' too (on XLA CPU each
call also hands the native kernels' work to their threads anew: a one-row step of the embedded model took ~1.2 ms
less, a 2,048-token prefill step about as long or less, for about the same start-up; docs/design/host_loop.md); other
devices one layer per call until a GPU run shows what the longer compile buys there, and there prefill steps of
more than SHORT_PREFILL_TOKENS tokens, whose kernels outlast their dispatch and which compile the longest, keep one
layer a call while shorter ones (a verification step of draft tokens, a short prompt) take the decode steps' runs."""
from __future__ import annotations

import dataclasses
import os
import sys

LAYERS_PER_CALL_ENV = "JVLLM_LAYERS_PER_CALL"
SHORT_PREFILL_TOKENS = 64  # prefill steps of up to this many tokens take the decode steps' runs of layers


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers start .. start + len(groups) - 1, called as one executable; `groups`: each layer's structure group."""

    start: int
    groups: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + len(self.groups)


def layers_per_call(default: int = 1) -> int:
    """The run length JVLLM_LAYERS_PER_CALL asks for, else `default`."""
    value = os.environ.get(LAYERS_PER_CALL_ENV, "").strip() or str(default)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{LAYERS_PER_CALL_ENV}={value!r}: expected a whole number of layers, 1 or more")
    return int(value)


def split_layers(layer_groups: tuple[int, ...], per_call: int) -> list[LayerRun]:
    """Consecutive runs of at most `per_call` layers covering every layer in order."""
    return [LayerRun(start, tuple(layer_groups[start:start + per_call]))
            for start in range(0, len(layer_groups), per_call)]


def runs_by_kind(layer_groups: tuple[int, ...], per_call: int) -> dict[str, list[LayerRun]]:
    """Per step kind ("decode", "prefill"), its layers' runs: `per_call` layers for decode steps, one for prefill."""
    return {"decode": split_layers(layer_groups, per_call), "prefill": split_layers(layer_groups, 1)}


def short_prefill_tokens(on_cpu: bool) -> int:
    """Prefill steps of up to this many tokens take the decode steps' runs: every one on a CPU."""
    return sys.maxsize if on_cpu else SHORT_PREFILL_TOKENS


def runs_kind(kind: str, tokens: int, short_prefill: int = SHORT_PREFILL_TOKENS) -> str:
    """Whose runs of layers (runs_by_kind's key) a step of this kind and token count calls, prefill steps of up to
    `short_prefill` tokens taking the decode steps'."""
    return "decode" if kind == "decode" or tokens <= short_prefill else "prefill"


def first_runs(runs: list[LayerRun]) -> dict[tuple[int, ...], LayerRun]:
    """Per distinct group pattern, its first run (whose weights stand for the pattern when compiling)."""
    firsts: dict[tuple[int, ...], LayerRun] = {}
    for run in runs:
        firsts.setdefault(run.groups, run)
    return firsts
