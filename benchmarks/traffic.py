"""Scenarios of real traffic for benchmarks.throughput: every timed pass runs prompts the engine has not seen.

- fixed vs varied: the same total input and output tokens, as equal-length random prompts or as a long-tailed
  mix (benchmarks.workloads.varied); the varied/fixed ratio of output tok/s is the figure.
- chat: uneven chat prompts x N tokens, jvllm and transformers' batched generate on the same prompts.
Each engine is warmed up on prompts of the same kind first (not the timed ones); each timed pass then takes a
new prompt set, so every pass is a first pass, as a user's traffic is."""
from __future__ import annotations

import statistics
import time
from typing import Callable

from benchmarks import workloads
from benchmarks.workloads import Workload


def jvllm_pass(engine, workload: Workload) -> float:
    """Greedy generation of the workload, each request exactly its output length; -> seconds."""
    from jvllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    started = time.perf_counter()
    outputs = engine.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == workload.output_tokens
    return elapsed


def _summary(seconds: list[float], workloads_run: list[Workload]) -> dict:
    rates = [w.output_tokens / s for w, s in zip(workloads_run, seconds)]
    return {"output_tokens_per_s": statistics.median(rates), "pass_output_tokens_per_s": rates,
            "pass_seconds": seconds, "pass_output_tokens": [w.output_tokens for w in workloads_run],
            "pass_input_tokens": [w.input_tokens for w in workloads_run]}


def fixed_vs_varied(engine, make: dict[str, Callable[[int], Workload]], repeats: int) -> dict:
    """Warm-up on one set of each kind (seed 0), then `repeats` rounds of (fixed, varied) on new sets."""
    for kind in make:
        jvllm_pass(engine, make[kind](0))
    seconds: dict[str, list[float]] = {kind: [] for kind in make}
    runs: dict[str, list[Workload]] = {kind: [] for kind in make}
    for round_ in range(1, repeats + 1):
        for kind in make:
            workload = make[kind](round_)
            seconds[kind].append(jvllm_pass(engine, workload))
            runs[kind].append(workload)
    result = {kind: _summary(seconds[kind], runs[kind]) for kind in make}
    result["varied_over_fixed"] = result["varied"]["output_tokens_per_s"] / result["fixed"]["output_tokens_per_s"]
    return result


def chat_vs_transformers(engine, baseline, num: int, output_len: int, repeats: int) -> dict:
    """32-style chat batches: warm-up on one set for each engine, then alternating timed passes on new sets."""
    tokenizer = engine.get_tokenizer()
    warm = workloads.chat(tokenizer, num, output_len, seed=0)
    jvllm_pass(engine, warm)
    if baseline is not None:
        baseline.use(warm.prompts)
        baseline.warm()
    jvllm_seconds, baseline_seconds, runs = [], [], []
    for round_ in range(1, repeats + 1):
        workload = workloads.chat(tokenizer, num, output_len, seed=round_)
        runs.append(workload)
        jvllm_seconds.append(jvllm_pass(engine, workload))
        if baseline is not None:
            baseline.use(workload.prompts)
            baseline_seconds.append(baseline.timed_pass())
    result = {"num_prompts": num, "output_len": output_len,
              "prompt_lens": [sorted(map(len, w.prompts)) for w in runs], "jvllm": _summary(jvllm_seconds, runs)}
    if baseline is not None:
        result["transformers"] = _summary(baseline_seconds, runs)
        result["ratio_vs_transformers"] = (result["jvllm"]["output_tokens_per_s"]
                                           / result["transformers"]["output_tokens_per_s"])
        result["pass_ratios"] = [b / j for j, b in zip(jvllm_seconds, baseline_seconds)]
    return result
