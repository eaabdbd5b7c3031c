"""A decode step's dispatch time on the host and its wall time under several ways of calling it, one process each.

The variants: XLA's command buffers (CUDA graphs: a run of kernels launched as one graph) as XLA sets them, off,
and for runs of any length; runs of several layers in one executable (JVLLM_LAYERS_PER_CALL), alone and with
command buffers for any length. Each variant runs `benchmarks.step_profile --no-trace` in its own process (XLA
reads its flags once a process) and its figures land in one JSON file, printed as a table as they come.

    python -m benchmarks.dispatch_variants --model .gpu/smollm2-shape --load-format dummy --dtype bfloat16 \\
        --rows 1,64 --json dispatch.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line, machine_info, write_json

NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
ANY_SIZE_GRAPHS = "--xla_gpu_graph_min_graph_size=1"
VARIANTS: dict[str, dict[str, str]] = {  # the most telling first: a run cut short by its budget still answers
    "one layer a call": {},
    "no command buffers": {"XLA_FLAGS": NO_COMMAND_BUFFERS},
    "8 layers a call": {"JVLLM_LAYERS_PER_CALL": "8"},
    "graphs of any size": {"XLA_FLAGS": ANY_SIZE_GRAPHS},
    "8 layers a call, graphs of any size": {"JVLLM_LAYERS_PER_CALL": "8", "XLA_FLAGS": ANY_SIZE_GRAPHS},
    "4 layers a call": {"JVLLM_LAYERS_PER_CALL": "4"},
    "every layer in one call": {"JVLLM_LAYERS_PER_CALL": "1000"},
}


def variant_env(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment with a variant's settings; XLA flags are added to those already set."""
    env = dict(os.environ)
    for name, value in settings.items():
        env[name] = f"{env.get(name, '')} {value}".strip() if name == "XLA_FLAGS" else value
    return env


def run_variant(name: str, settings: dict[str, str], profile_args: list[str], limit_s: float) -> dict:
    """step_profile under one variant's settings; -> {variant, settings, seconds, steps | error}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        command = [sys.executable, "-m", "benchmarks.step_profile", "--no-trace", *profile_args, "--json", str(out)]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, env=variant_env(settings), capture_output=True, text=True,
                                  timeout=limit_s)
            last_lines = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            error = None if done.returncode == 0 else last_lines
        except subprocess.TimeoutExpired:
            error = [f"over its {limit_s:.0f} s"]
        record = {"variant": name, "settings": settings, "seconds": round(time.perf_counter() - started, 1)}
        if out.exists():
            record["steps"] = json.loads(out.read_text())["steps"]
        if error:
            record["error"] = error[0]
        return record


def report(record: dict) -> None:
    for step in record.get("steps", []):
        print(f"{record['variant']:<40} {step['sequences']:>4} rows  {step['wall_ms']:7.2f} ms wall  "
              f"{step['dispatch_ms']:7.2f} ms dispatch", flush=True)
    if "error" in record:
        print(f"{record['variant']:<40} failed after {record['seconds']} s: {record['error']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default=None, help="e.g. mosaic (default: the engine's default)")
    parser.add_argument("--rows", default="1,64", help="sequences in the timed decode steps")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from: "
                        + ", ".join(VARIANTS))
    parser.add_argument("--budget-s", type=float, default=150.0, help="variants not started by then are skipped")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    profile_args = ["--load-format", args.load_format, "--dtype", args.dtype, "--rows", args.rows,
                    "--batched-weight-dtype", "none", "--no-precompile", "--prompt-len", "128",
                    "--output-len", "8", "--steps", "9"]
    if args.model:
        profile_args += ["--model", args.model]
    if args.attention_backend:
        profile_args += ["--attention-backend", args.attention_backend]
    record = {"command": command_line("benchmarks.dispatch_variants", argv), "machine": machine_info(),
              "variants": []}
    deadline = time.perf_counter() + args.budget_s
    for name in names:
        left = deadline - time.perf_counter()
        if left < 10:
            print(f"budget of {args.budget_s:.0f} s spent: {name} and later variants not run", flush=True)
            break
        record["variants"].append(run_variant(name, VARIANTS[name], profile_args, left))
        report(record["variants"][-1])
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
