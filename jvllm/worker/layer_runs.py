"""How a step's layers are split into runs of consecutive layers, each run one executable call.

Each call of a compiled piece costs the host a fixed amount of work (arguments, the runtime's bookkeeping, on a GPU
the launch of each kernel), so a step of L layers called one layer at a time pays it L times. A run of n layers in
one executable pays it L / n times; its compile takes about n times one layer's. JVLLM_LAYERS_PER_CALL sets n for
decode steps and for the prefill steps that take their runs.

By default a CPU engine whose attention is the native `cpu` backend runs all of a step's layers in one call,
prefill steps included: on XLA CPU a call also hands the native kernels' work to their helper threads anew, and
compiling the whole run costs about what the pieces do (docs/design/host_loop.md). Where the attention is XLA's own
(the `xla` backend, a CPU without the native kernels; the Pallas kernels in interpret mode), a layer's program is
large and its compile grows with the run, so those engines, like other devices, call one layer at a time (the GPU
until a device run shows what the longer compile buys there); their prefill steps of up to SHORT_PREFILL_TOKENS
tokens (a verification step of draft tokens, a short prompt) take the decode steps' runs, longer ones, whose kernels
outlast their dispatch, one layer a call."""
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


def whole_step_runs(platform: str, attention: str) -> bool:
    """Whether a step's layers run in one call by default: on a CPU whose attention is the native kernel."""
    return platform == "cpu" and attention == "cpu"


def short_prefill_tokens(whole_steps: bool) -> int:
    """Prefill steps of up to this many tokens take the decode steps' runs: every one where those are whole steps."""
    return sys.maxsize if whole_steps else SHORT_PREFILL_TOKENS


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
