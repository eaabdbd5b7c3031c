"""What the engine's host loop costs per step when the model costs almost nothing: the floor of a step's time.

A GPU step of a large model waits on the host whenever the host's work per step (scheduling, packing the inputs,
dispatching the jitted pieces, reading the sampled ids, appending them, building outputs) outlasts the device's.
This runs the engine on a near-free model (a tiny llama config with `--layers` layers, so as many pieces are
dispatched per step as for the real model; dummy weights; the embedded model's tokenizer) over `--rows` requests of
128 prompt tokens and `--output-len` tokens each, and prints per decode step: the wall time, the main thread's CPU
time, and that CPU time by phase. The main thread's CPU time is what the host spends; on a GPU machine it is the
bound below which no step of any model can go.

    python -m benchmarks.host_loop                      # 1, 64 and 256 requests, 32 layers (Llama-3-8B's count)
    python -m benchmarks.host_loop --rows 64 --layers 30 --json host_loop.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import command_line, machine_info, write_json

VOCAB = 1024  # ids the random prompts and the model use (the tokenizer decodes them all)


def near_free_model(folder: Path, layers: int, tokenizer_from: str | None = None) -> Path:
    """A llama config of `layers` layers of hidden size 64 in `folder`, with the tokenizer of the folder
    `tokenizer_from` (default: the embedded model's)."""
    from benchmarks.gpu_models import TINY_BASE, TINY_FAMILIES, write_folder
    from jvllm.model_loader.loader import transformers_folder

    config = {**TINY_BASE, **TINY_FAMILIES["llama"], "num_hidden_layers": layers, "vocab_size": VOCAB,
              "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1,
              "max_position_embeddings": 4096}
    return write_folder(folder, config, Path(tokenizer_from or transformers_folder(None)))


class PhaseClock:
    """Main-thread CPU seconds spent in wrapped callables, by phase."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._wrapped: list[tuple[Any, str, Callable]] = []  # (owner, name, the callable before wrapping)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable = getattr(owner, name)
        self._wrapped.append((owner, name, inner))

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - start

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Put back every wrapped callable (module functions included)."""
        for owner, name, inner in reversed(self._wrapped):
            setattr(owner, name, inner)
        self._wrapped.clear()


# (module or engine attribute path, callable name, phase) timed inside one step; nested phases overlap
PHASES = (
    ("jvllm.engine.step_plan", "plan_chunks", "plan the chunks (rows, sampler specs)"),
    ("runner", "step_call", "pack the step's host arrays"),
    ("runner", "layer_inputs", "send the changed inputs"),
    ("runner", "sampler_inputs", "send the changed inputs"),
    ("runner", "run_call", "run_call: send + dispatch every jitted piece"),
    ("runner", "collect", "read the sampled ids"),
    ("engine", "_process_results", "append tokens, stop checks, outputs"),
    ("jvllm.engine.llm", "lookahead_possible", "plan the look-ahead step"),
    ("jvllm.engine.llm", "reserve_lookahead", "plan the look-ahead step"),
    ("engine", "_settle_ahead", "settle the look-ahead step"),
    ("scheduler", "schedule", "schedule"),
)


def instrument(engine: Any) -> PhaseClock:
    import importlib

    clock = PhaseClock()
    owners = {"engine": engine, "runner": engine.runner, "scheduler": engine.scheduler}
    for owner, name, phase in PHASES:
        clock.wrap(owners.get(owner) or importlib.import_module(owner), name, phase)
    return clock


def measure(engine: Any, clock: PhaseClock, rows: int, output_len: int, repeats: int) -> dict:
    """Median over `repeats` passes (after one warm-up pass) of per-step figures."""
    from benchmarks.throughput import random_prompts
    from jvllm import SamplingParams

    from jvllm.worker.compile_watch import compile_watch

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    passes = []
    compiles_before_timed = None
    for seed in range(repeats + 1):
        if seed == 1:
            compiles_before_timed = compile_watch().total
        prompts = [{"prompt_token_ids": p} for p in random_prompts(rows, 128, VOCAB, seed=1000 * rows + seed)]
        clock.seconds.clear()
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.generate(prompts, params, use_tqdm=False)
        passes.append({"wall": time.perf_counter() - wall, "cpu": time.thread_time() - cpu, **clock.seconds})
    timed = passes[1:]
    per_step = {key: statistics.median(p.get(key, 0.0) for p in timed) / output_len * 1e3 for key in timed[0]}
    # with --no-precompile the warm-up pass compiles what the passes meet; a compile in a timed pass inflates it
    return {"rows": rows, "output_len": output_len, "wall_ms_per_step": per_step.pop("wall"),
            "main_thread_cpu_ms_per_step": per_step.pop("cpu"), "phases_ms_per_step": per_step,
            "compiles_in_timed_passes": compile_watch().total - compiles_before_timed}


def report(result: dict) -> None:
    print(f"{result['rows']} requests: {result['wall_ms_per_step']:.2f} ms a step of wall time, "
          f"{result['main_thread_cpu_ms_per_step']:.2f} ms of the main thread's CPU time"
          + (f" ({result['compiles_in_timed_passes']} compiles in the timed passes)"
             if result["compiles_in_timed_passes"] else ""), flush=True)
    for phase, ms in sorted(result["phases_ms_per_step"].items(), key=lambda item: -item[1]):
        print(f"    {ms:7.3f} ms  {phase}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,64,256", help="comma-separated request counts")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every step shape at start (--no-precompile: only the shapes the passes meet)")
    parser.add_argument("--tokenizer-from", default=None,
                        help="a model folder whose tokenizer files to use (default: the embedded SmolLM2's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from jvllm import Engine

    rows_list = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = near_free_model(Path(tmp) / "near-free", args.layers, args.tokenizer_from)
        engine = Engine(model=str(model), load_format="dummy", dtype="float32", max_num_seqs=max(rows_list),
                        precompile=args.precompile)
        clock = instrument(engine)
        results = []
        try:
            for rows in rows_list:
                results.append(measure(engine, clock, rows, args.output_len, args.repeats))
                report(results[-1])
        finally:
            clock.restore()
    if args.json:
        write_json(args.json, {"benchmark": "host_loop", "command": command_line("benchmarks.host_loop", None),
                               "machine": machine_info(), "layers": args.layers, "results": results})


if __name__ == "__main__":
    sys.exit(main())
