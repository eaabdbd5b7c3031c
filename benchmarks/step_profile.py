"""Where one decode (or prefill) step's device time goes: per-op times from a jax.profiler trace of the jitted step.

Runs `--rows` greedy requests to capture a decode step of that many sequences, replays it under the profiler,
and prints the step's wall time, the host's time to dispatch it, and the ops that took the most time, grouped by
kind. On a CPU the ops are XLA's thunks (kind: the op name before its first '.', e.g. `dot`, `ynn_fusion`,
`while`; custom calls by their target, e.g. `jvllm_quantized_matmul`, `jvllm_paged_attention`; ops inside a
`while` also count in that `while`). On a GPU they are the kernels on the device's streams (kind: the jitted
piece that launched them, e.g. `jit_layer`, `jit_head_logits`), and the device's busy time (the union of its
kernels' intervals) says how much of the wall time the device worked: the rest is the device waiting on the host.

    python -m benchmarks.step_profile --rows 64
    python -m benchmarks.step_profile --rows 32 --prefill
    python -m benchmarks.step_profile --model M --load-format dummy --dtype bfloat16 --no-precompile --rows 1,64
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import statistics
import sys
import tempfile
import time

from benchmarks.common import command_line, machine_info, write_json

# Trace events that are runtime bookkeeping or Python frames rather than XLA ops.
_RUNTIME_PREFIXES = ("$", "PjitFunction", "ThunkExecutor", "SlinkyThreadPool", "CommonPjRt", "Handle inputs",
                     "ParseArguments", "end: ")


def capture_calls(engine, rows: int, prompt_len: int, output_len: int) -> list:
    """Run `rows` greedy requests of fresh prompts; -> every step call the runner ran, in order."""
    from benchmarks.throughput import random_prompts
    from jvllm import SamplingParams

    runner = engine.runner
    calls = []
    run_call = runner.run_call
    runner.run_call = lambda call, *args: (calls.append(call), run_call(call, *args))[1]
    try:
        engine.reset_prefix_cache()
        prompts = random_prompts(rows, prompt_len, engine.model.config.vocab_size, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.run_call = run_call
    return calls


def capture_decode_call(engine, rows: int, prompt_len: int, output_len: int):
    """Run `rows` greedy requests; -> the last step call that decoded `rows` sequences (one token each)."""
    decodes = [c for c in capture_calls(engine, rows, prompt_len, output_len)
               if c.input_ids.shape[0] == c.metadata.page_tables.shape[0]
               and int((c.metadata.q_lens > 0).sum()) == rows]
    if not decodes:
        raise SystemExit(f"no decode step with {rows} sequences was run")
    return decodes[-1]


def capture_prefill_call(engine, rows: int, prompt_len: int):
    """-> the first step call of `rows` fresh prompts: their prefill (as many as max_num_batched_tokens allows)."""
    return capture_calls(engine, rows, prompt_len, 1)[0]


def replay_seconds(engine, call) -> float:
    """Run a captured step call once more and wait for its outputs and the K/V pool; -> wall seconds."""
    return replay_times(engine, call)[1]


def replay_times(engine, call) -> tuple[float, float]:
    """Run a captured step call once more; -> (seconds until the host had dispatched it, seconds until its outputs
    and the K/V pool were ready)."""
    import jax

    started = time.perf_counter()
    outputs = engine.runner.run_call(call)
    dispatched = time.perf_counter() - started
    jax.block_until_ready((outputs, engine.runner.kv_cache))
    return dispatched, time.perf_counter() - started


def custom_call_targets(texts: list[str]) -> dict[tuple[str, str], str]:
    """(module name, op name) -> custom-call target, from optimized HLO texts (one or more modules each)."""
    import re

    targets = {}
    module = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("HloModule "):
                module = line.split()[1].rstrip(",")  # HloModule jit_layer, entry_computation_layout=...
                continue
            found = re.search(r"%(\S+) = .* custom-call\(.*custom_call_target=\"([^\"]+)\"", line)
            if found:
                targets.setdefault((module, found.group(1)), found.group(2))
    return targets


def step_hlo_texts(engine, call) -> list[str]:
    """The optimized HLO of the executables a step of `call`'s shape runs: the trace names an op by its module's
    name (`jit_layer`) and op, which other shapes' executables of the same name reuse for other ops."""
    executables = engine.runner.compiled.get(call.shape)
    pieces = [executables.embed, *executables.layers.values(), executables.last_rows, executables.store_kv,
              executables.take_ids, executables.prompt_stats]
    texts = [piece.as_text() for piece in pieces if hasattr(piece, "as_text")]
    return texts + [executables.head.as_text(call.flags)]


def trace_events(trace_dir: str) -> list[dict]:
    """The events of the perfetto trace under `trace_dir`."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def device_pids(events: list[dict]) -> set[int]:
    """The trace's accelerator processes (`/device:GPU:0`, ...); empty on a CPU, whose ops run in `/host:CPU`."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and e.get("args", {}).get("name", "").startswith("/device:")}


def kernel_times(events: list[dict], steps: int) -> tuple[collections.Counter, collections.Counter, float, float]:
    """On an accelerator: (microseconds per step by launching module (`jit_layer`, ...), microseconds per step by
    `module: kernel`, the device's busy microseconds per step: the union of its kernels' intervals, kernels per
    step: each one a launch the host made)."""
    pids = device_pids(events)
    # a device's kernels are on its stream lines; lines that summarize them again (XLA modules or ops) are left out
    streams = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in pids and e.get("args", {}).get("name", "").startswith("Stream")}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in pids
               and (not streams or (e["pid"], e.get("tid")) in streams)]
    by_module: collections.Counter = collections.Counter()
    by_kernel: collections.Counter = collections.Counter()
    for event in kernels:
        module = event.get("args", {}).get("hlo_module", "?").split("(")[0]
        by_module[module] += event["dur"] / steps
        by_kernel[f"{module}: {event['name'][:80]}"] += event["dur"] / steps
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return by_module, by_kernel, busy / steps, len(kernels) / steps


def op_times(events: list[dict], steps: int, targets: dict[tuple[str, str], str] | None = None) -> collections.Counter:
    """On a CPU: microseconds per step of each XLA op in the trace's `events` (custom calls named `target:op` where
    `targets` knows them)."""
    totals: collections.Counter = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and not name.startswith(_RUNTIME_PREFIXES) and "::" not in name:
            target = (targets or {}).get((event.get("args", {}).get("hlo_module", ""), name))
            totals[f"{target}:{name}" if target else name] += event["dur"] / steps
    return totals


def profile_step(engine, call, steps: int, top: int, trace: bool = True) -> dict:
    """Replay `call` `steps` times outside and then (with `trace`) under the profiler; -> its wall and dispatch
    times and where the time went (ms per step), printed too."""
    import jax

    replay_times(engine, call)
    times = [replay_times(engine, call) for _ in range(steps)]
    wall_ms = 1e3 * statistics.median(t[1] for t in times)
    dispatch_ms = 1e3 * statistics.median(t[0] for t in times)
    rows = int((call.metadata.q_lens > 0).sum())
    result = {"kind": call.shape.kind, "sequences": rows, "token_rows": int(call.input_ids.shape[0]),
              "wall_ms": wall_ms, "dispatch_ms": dispatch_ms}
    print(f"{call.shape.kind} step of {rows} sequences, {call.input_ids.shape[0]} token rows, "
          f"{call.metadata.page_tables.shape[1]} pages per row: {wall_ms:.2f} ms wall, {dispatch_ms:.2f} ms to "
          f"dispatch (medians of {steps}, outside the profiler)")
    if not trace:
        return result
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                replay_times(engine, call)
        events = trace_events(trace_dir)
    if device_pids(events):
        kinds, totals, busy, launches = kernel_times(events, steps)
        result["device_busy_ms"], result["kernels_per_step"] = busy / 1e3, launches
        print(f"  {busy / 1e3:8.2f}  device busy (ms per step, under the profiler); the device waited "
              f"{max(0.0, wall_ms - busy / 1e3):.2f} ms of the wall time; {launches:.0f} kernels a step")
    else:
        totals = op_times(events, steps, custom_call_targets(step_hlo_texts(engine, call)))
        kinds = collections.Counter()
        for name, micros in totals.items():
            kinds[name.split(":")[0] if ":" in name else name.split(".")[0]] += micros
        op_ms = sum(micros for name, micros in totals.items() if not name.startswith(("shard_args", "DevicePut")))
        print(f"  {wall_ms - op_ms / 1e3:8.2f}  the rest of the wall time (host: dispatch, Python; ops under the "
              f"profiler run slower, so this is a lower bound)")
    print("by kind (ms per step):")
    for kind, micros in kinds.most_common(12):
        print(f"  {micros / 1e3:8.2f}  {kind}")
    print(f"top {top} ops (ms per step):")
    for name, micros in totals.most_common(top):
        print(f"  {micros / 1e3:8.2f}  {name}")
    result["by_kind_ms"] = {k: v / 1e3 for k, v in kinds.most_common(12)}
    result["top_ops_ms"] = {k: v / 1e3 for k, v in totals.most_common(top)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", default="1", help="sequences in the profiled step; a comma list profiles each")
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first prefill step of the rows' prompts instead of a decode step")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=40, help="tokens generated before the profiled step")
    parser.add_argument("--steps", type=int, default=5, help="replays of the step under the profiler")
    parser.add_argument("--top", type=int, default=15, help="how many single ops to list")
    parser.add_argument("--batched-weight-dtype", default="bfloat16", help="as in benchmarks.throughput")
    parser.add_argument("--kv-cache-dtype", default="auto", help="what the KV pages hold: auto, bfloat16, float32")
    parser.add_argument("--attention-backend", default=None, help="e.g. mosaic (default: the engine's default)")
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every step shape at start (--no-precompile: only the shapes the capture runs)")
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                        help="profile the replays (--no-trace: only time them, wall and dispatch)")
    parser.add_argument("--json", default=None, help="write the results here (rewritten after each --rows value)")
    args = parser.parse_args(argv)
    from jvllm import Engine

    rows_list = [int(r) for r in args.rows.split(",")]
    started = time.perf_counter()
    engine = Engine(args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=max(rows_list),
                    batched_weight_dtype=None if args.batched_weight_dtype == "none" else args.batched_weight_dtype,
                    kv_cache_dtype=args.kv_cache_dtype, precompile=args.precompile,
                    **({} if args.attention_backend is None else {"attention_backend": args.attention_backend}))
    record = {"command": command_line("benchmarks.step_profile", argv), "machine": machine_info(),
              "engine_start_s": time.perf_counter() - started, "steps": []}
    for rows in rows_list:
        if args.prefill:
            call = capture_prefill_call(engine, rows, args.prompt_len)
        else:
            call = capture_decode_call(engine, rows, args.prompt_len, args.output_len)
        record["steps"].append(profile_step(engine, call, args.steps, args.top, args.trace))
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
