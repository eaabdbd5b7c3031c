"""On a GPU: the `pallas` backend's greedy tokens against the `xla` backend's, one tiny dummy-weight model per family.

Each family's folder comes from benchmarks/gpu_models.py (config + tokenizer; `load_format="dummy"` draws the same
weights for both engines). Both engines run float32 with two sequences and a 16-token step budget (three step
shapes), so the longer prompts are prefilled in chunks beside another request's decode row; the prompts' lengths (1 to 45 tokens) cross page
boundaries and the 16-token sliding windows. A second round continues each prompt with its first round's tokens
(pallas's), so both engines start it from the prefix cache, the partial last pages copied on the device. The pallas
engine precompiles its step shapes, and the check counts the executables compiled after that (should be 0). One JSON line per family is appended to --json as it finishes.

    python -m benchmarks.gpu_greedy --root .gpu --json out.jsonl [--families llama,gemma2] [--jobs 9] [--budget-s 90]

With --jobs N each family runs in its own process, N at a time (compiling is host work; the GPU has room).
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import numpy as np

from benchmarks.gpu_models import TINY_FAMILIES

PROMPT_LENGTHS = (1, 9, 20, 45)
OUTPUT_TOKENS = 24
# families whose kernels' paths differ most come first, so a cut-short run still covers them
ORDER = ("llama", "gemma2", "mistral", "qwen3", "mixtral", "phi3", "gemma3", "qwen2", "qwen3_moe")


def _engine(folder: str, tokenizer: str, backend: str, precompile: bool):
    from jvllm import Engine

    return Engine(folder, tokenizer=tokenizer, load_format="dummy", dtype="float32", attention_backend=backend, max_model_len=128,
                  max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory_bytes=8 << 20, precompile=precompile,
                  seed=0)


def compare_family(folder: str, tokenizer: str) -> dict:
    """Greedy generations of both backends on the same prompts; -> what matched, the largest logprob gap and the
    pallas engine's compiles after start."""
    from jvllm import SamplingParams
    from jvllm.worker.compile_watch import compile_watch

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 49000, size=n).tolist()} for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, logprobs=1)
    started = time.perf_counter()
    engine = _engine(folder, tokenizer, "pallas", precompile=True)
    start_s = time.perf_counter() - started
    before = compile_watch().unexpected
    got = engine.generate(prompts, params, use_tqdm=False)
    follow_ups = [{"prompt_token_ids": prompt["prompt_token_ids"] + list(out.outputs[0].token_ids)}
                  for prompt, out in zip(prompts, got)]
    got += engine.generate(follow_ups, params, use_tqdm=False)
    compiles_after_start = compile_watch().unexpected - before
    del engine
    gc.collect()
    with compile_watch().expected():  # the reference engine compiles each shape as it meets it
        reference = _engine(folder, tokenizer, "xla", precompile=False)
        expected = reference.generate(prompts, params, use_tqdm=False)
        expected += reference.generate(follow_ups, params, use_tqdm=False)
    del reference
    gc.collect()
    first_diff, gap = None, 0.0
    for i, (out, ref) in enumerate(zip(got, expected)):
        ids, ref_ids = out.outputs[0].token_ids, ref.outputs[0].token_ids
        if ids != ref_ids and first_diff is None:
            first_diff = [i, next(j for j, (a, b) in enumerate(zip(ids, ref_ids)) if a != b)]
        shared = first_diff[1] if first_diff and first_diff[0] == i else len(ids)
        for step, ref_step in list(zip(out.outputs[0].logprobs, ref.outputs[0].logprobs))[:shared]:
            token = next(iter(ref_step))
            if token in step:
                gap = max(gap, abs(step[token].logprob - ref_step[token].logprob))
    return {"tokens_equal": first_diff is None, "first_difference": first_diff, "max_logprob_gap": gap,
            "pallas_compiles_after_start": compiles_after_start, "pallas_start_s": round(start_s, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".gpu")
    parser.add_argument("--families", default=",".join(ORDER))
    parser.add_argument("--budget-s", type=float, default=None, help="start no family after this many seconds")
    parser.add_argument("--jobs", type=int, default=1, help="families checked at once, each in its own process")
    parser.add_argument("--json", default=None, help="append one JSON line per family here")
    args = parser.parse_args(argv)
    import jax

    # XLA's float32 dots on a GPU default to TF32; the kernels' are IEEE float32, so the reference is made so too
    jax.config.update("jax_default_matmul_precision", "highest")
    names = [name for name in args.families.split(",") if name]
    unknown = set(names) - set(TINY_FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(TINY_FAMILIES)}")
    if args.jobs > 1:
        return _run_in_processes(names, args)
    started, failures = time.perf_counter(), 0
    for name in names:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            print(f"{name}: skipped (budget of {args.budget_s:.0f} s spent)", flush=True)
            continue
        try:
            row = {"family": name, **compare_family(f"{args.root}/tiny-{name}", f"{args.root}/smollm2-shape")}
        except Exception as err:  # one family's failure should not hide the others'
            row = {"family": name, "error": f"{type(err).__name__}: {err}"[:2000]}
        ok = row.get("tokens_equal") and row.get("pallas_compiles_after_start") == 0
        failures += not ok
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return 1 if failures else 0


def _run_in_processes(names: list[str], args: argparse.Namespace) -> int:
    """This script once per family, `args.jobs` at a time; -> 1 if any of them failed."""
    base = ["--root", args.root] + (["--json", args.json] if args.json else [])
    pending, running, failed = list(names), [], False
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            running.append(subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_greedy", *base,
                                              "--families", name]))
        time.sleep(0.5)
        for proc in [p for p in running if p.poll() is not None]:
            failed |= proc.returncode != 0
            running.remove(proc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
