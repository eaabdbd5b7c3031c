"""The engine settings a GPU run's own measurements favour, as `NAME=VALUE` words for `env`, so that one device call
can measure the ways of dispatching a step and then run the engine the fastest way.

Reads, from one results folder: `dispatch_smollm2_gpu.json` (`benchmarks.dispatch_variants`: a decode step's wall time
under each variant) and `host_loop_gpu.json` / `host_loop_thread_gpu.json` (`benchmarks.host_loop` without and with
JVLLM_DISPATCH_THREAD=1). A variant replaces the default (one layer a call, XLA's own command-buffer settings) only
if its step at the most rows measured takes less than `--margin` of the default's; the dispatch thread is
turned on only if the engine's wall time per step at the most rows drops by as much. Prints the chosen words on one
line (empty: the defaults) and why on stderr; a missing or failed measurement keeps its default.

    python -m benchmarks.gpu_settings benchmarks/results/gpu-run        # e.g. JVLLM_LAYERS_PER_CALL=8
    env $(python -m benchmarks.gpu_settings "$OUT") python -m benchmarks.throughput ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_VARIANT = "one layer a call"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wall_at_most_rows(steps: list[dict]) -> tuple[int, float] | None:
    """(rows, wall ms) of the step with the most sequences."""
    if not steps:
        return None
    step = max(steps, key=lambda s: s["sequences"])
    return step["sequences"], step["wall_ms"]


def dispatch_choice(record: dict | None, margin: float) -> tuple[dict[str, str], str]:
    """-> (the favoured variant's settings, why)."""
    if record is None:
        return {}, "no dispatch measurements: the defaults"
    walls = {v["variant"]: (_wall_at_most_rows(v.get("steps", [])), v["settings"])
             for v in record.get("variants", []) if "error" not in v}
    walls = {name: value for name, value in walls.items() if value[0] is not None}
    if DEFAULT_VARIANT not in walls:
        return {}, "the default way was not measured: the defaults"
    (rows, base), _ = walls[DEFAULT_VARIANT]
    same_rows = {name: (wall, settings) for name, ((r, wall), settings) in walls.items() if r == rows}
    best = min(same_rows, key=lambda name: same_rows[name][0])
    wall, settings = same_rows[best]
    if best == DEFAULT_VARIANT or wall >= margin * base:
        return {}, f"no variant under {margin:.2f}x the default's {base:.2f} ms at {rows} rows (best: {best}, {wall:.2f})"
    return dict(settings), f"{best}: {wall:.2f} ms against {base:.2f} ms at {rows} rows"


def thread_choice(plain: dict | None, threaded: dict | None, margin: float) -> tuple[dict[str, str], str]:
    """-> ({"JVLLM_DISPATCH_THREAD": "1"} or {}, why)."""
    if plain is None or threaded is None:
        return {}, "no host-loop measurements with and without the dispatch thread: off"
    rows = max(r["rows"] for r in plain["results"])
    wall = {name: next((r["wall_ms_per_step"] for r in record["results"] if r["rows"] == rows), None)
            for name, record in (("plain", plain), ("threaded", threaded))}
    if wall["plain"] is None or wall["threaded"] is None:
        return {}, f"no step of {rows} requests measured both ways: off"
    verdict = f"{wall['threaded']:.2f} ms a step with the dispatch thread against {wall['plain']:.2f} at {rows} requests"
    return ({"JVLLM_DISPATCH_THREAD": "1"}, verdict) if wall["threaded"] < margin * wall["plain"] else ({}, verdict)


def settings_words(folder: Path, margin: float) -> tuple[list[str], list[str]]:
    """-> (NAME=VALUE words, the reasons)."""
    chosen, why_dispatch = dispatch_choice(_read(folder / "dispatch_smollm2_gpu.json"), margin)
    thread, why_thread = thread_choice(_read(folder / "host_loop_gpu.json"),
                                       _read(folder / "host_loop_thread_gpu.json"), margin)
    words = []
    for name, value in {**chosen, **thread}.items():
        if any(c.isspace() for c in value):
            raise ValueError(f"{name}={value!r}: a value with spaces cannot pass through env as one word")
        words.append(f"{name}={value}")
    return words, [why_dispatch, why_thread]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the results folder of the dispatch and host stages")
    parser.add_argument("--margin", type=float, default=0.97,
                        help="a setting must bring the step under this fraction of the default's time")
    args = parser.parse_args(argv)
    words, reasons = settings_words(args.folder, args.margin)
    for reason in reasons:
        print(f"gpu_settings: {reason}", file=sys.stderr)
    print(" ".join(words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
