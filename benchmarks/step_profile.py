"""Where one decode (or prefill) step's device time goes: per-op times from a jax.profiler trace of the jitted step.

Runs `--rows` greedy requests to capture a decode step of that many sequences, replays it under the profiler,
and prints the step's wall time with the XLA ops (thunks) that took the most time, grouped by kind (the op
name before its first '.', e.g. `dot`, `ynn_fusion`, `transpose_copy_fusion`, `while`; custom calls by their
target, e.g. `jvllm_quantized_matmul`, `jvllm_paged_attention`), and what the ops leave of the wall time (host work:
dispatching the step's jitted calls, Python). Ops that run inside a `while` also count in that `while`.

    python -m benchmarks.step_profile --rows 64
    python -m benchmarks.step_profile --rows 32 --prefill
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
    import jax

    started = time.perf_counter()
    jax.block_until_ready((engine.runner.run_call(call), engine.runner.kv_cache))
    return time.perf_counter() - started


def custom_call_targets(dump_dir: str) -> dict[tuple[str, str], str]:
    """(module name, op name) -> custom-call target, from the optimized HLO text XLA dumped into `dump_dir`."""
    import re

    targets = {}
    for path in glob.glob(f"{dump_dir}/*after_optimizations.txt"):
        module = path.split("/")[-1].split(".")[1]  # module_0014.jit_layer.cpu_after_optimizations.txt
        for line in open(path):
            found = re.search(r"%(\S+) = .* custom-call\(.*custom_call_target=\"([^\"]+)\"", line)
            if found:
                targets[(module, found.group(1))] = found.group(2)
    return targets


def op_times(trace_dir: str, steps: int, targets: dict[tuple[str, str], str] | None = None) -> collections.Counter:
    """-> microseconds per step of each XLA op in the perfetto trace under `trace_dir` (custom calls named
    `target:op` where `targets` knows them)."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    totals: collections.Counter = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and not name.startswith(_RUNTIME_PREFIXES) and "::" not in name:
            target = (targets or {}).get((event.get("args", {}).get("hlo_module", ""), name))
            totals[f"{target}:{name}" if target else name] += event["dur"] / steps
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--rows", type=int, default=1, help="sequences in the profiled step")
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first prefill step of the rows' prompts instead of a decode step")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=40, help="tokens generated before the profiled step")
    parser.add_argument("--steps", type=int, default=5, help="replays of the step under the profiler")
    parser.add_argument("--top", type=int, default=15, help="how many single ops to list")
    parser.add_argument("--batched-weight-dtype", default="bfloat16", help="as in benchmarks.throughput")
    parser.add_argument("--kv-cache-dtype", default="auto", help="what the KV pages hold: auto, bfloat16, float32")
    args = parser.parse_args(argv)
    import os

    dump_dir = tempfile.mkdtemp(prefix="step-profile-hlo-")  # to name each custom call by its target
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"

    import jax

    from jvllm import Engine

    engine = Engine(args.model, load_format=args.load_format, max_num_seqs=max(args.rows, 1),
                    batched_weight_dtype=None if args.batched_weight_dtype == "none" else args.batched_weight_dtype,
                    kv_cache_dtype=args.kv_cache_dtype)
    if args.prefill:
        call = capture_prefill_call(engine, args.rows, args.prompt_len)
    else:
        call = capture_decode_call(engine, args.rows, args.prompt_len, args.output_len)
    replay_seconds(engine, call)
    walls = [replay_seconds(engine, call) for _ in range(args.steps)]
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.steps):
                replay_seconds(engine, call)
        totals = op_times(trace_dir, args.steps, custom_call_targets(dump_dir))
    kinds: collections.Counter = collections.Counter()
    for name, micros in totals.items():
        kinds[name.split(":")[0] if ":" in name else name.split(".")[0]] += micros
    kind = "prefill" if args.prefill else "decode"
    print(f"{kind} step, {call.input_ids.shape[0]} token rows, {call.metadata.page_tables.shape[1]} pages per row: "
          f"{1e3 * statistics.median(walls):.1f} ms wall (median of {args.steps}, outside the profiler)")
    print("by kind (ms per step):")
    for kind, micros in kinds.most_common(12):
        print(f"  {micros / 1e3:8.2f}  {kind}")
    op_ms = sum(micros for name, micros in totals.items() if not name.startswith(("shard_args", "DevicePut"))) / 1e3
    print(f"  {1e3 * statistics.median(walls) - op_ms:8.2f}  the rest of the wall time (host: dispatch, Python; "
          f"ops under the profiler run slower, so this is a lower bound)")
    print(f"top {args.top} ops (ms per step):")
    for name, micros in totals.most_common(args.top):
        print(f"  {micros / 1e3:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
