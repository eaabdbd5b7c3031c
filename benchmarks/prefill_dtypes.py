"""Prefill speed of the engine's `batched_weight_dtype` settings, side by side in one process.

Each setting gets its own `LLM()` (defaults otherwise, prefix caching off so every pass prefills in full). Every
round gives each engine the same new batch of prompts of uneven length (notes from benchmarks.workloads cut to
64-700 tokens) with one output token each, the engines' order alternating between rounds, after a warm-up batch of
other prompts. Prints prompt tokens per second per round, the medians, and each setting's ratio to the first's.

    python -m benchmarks.prefill_dtypes                       # auto against int8 (8-bit tiles for 4-, 5-bit blocks)
    python -m benchmarks.prefill_dtypes --settings auto,bfloat16,none --rounds 6 --output-json prefill.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.workloads import long_document


def prompt_batch(tokenizer, num: int, seed: int) -> list[dict]:
    """`num` prompts of 64-700 tokens, each the start of its own notes document."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 701, size=num)
    return [{"prompt_token_ids": tokenizer.encode(long_document(4000, seed * 1000 + i))[:int(n)]}
            for i, n in enumerate(lengths)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--settings", default="auto,int8", help="comma-separated batched_weight_dtype values")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    from jvllm import LLM, SamplingParams

    settings = args.settings.split(",")
    model = {} if args.model is None else {"model": args.model}
    engines = {name: LLM(batched_weight_dtype=name, enable_prefix_caching=False, **model) for name in settings}
    tokenizer = engines[settings[0]].get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1)
    for engine in engines.values():
        engine.generate(prompt_batch(tokenizer, args.num_prompts, seed=10_000), params, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for round_index in range(args.rounds):
        batch = prompt_batch(tokenizer, args.num_prompts, seed=round_index)
        tokens = sum(len(prompt["prompt_token_ids"]) for prompt in batch)
        order = settings if round_index % 2 == 0 else settings[::-1]
        for name in order:
            started = time.perf_counter()
            engines[name].generate(batch, params, use_tqdm=False)
            rates[name].append(tokens / (time.perf_counter() - started))
        print(f"round {round_index + 1}: " + ", ".join(f"{name} {rates[name][-1]:.0f}" for name in settings)
              + " prompt tok/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratios = {name: medians[name] / medians[settings[0]] for name in settings}
    for name in settings:
        print(f"{name}: median {medians[name]:.0f} prompt tok/s ({ratios[name]:.2f}x {settings[0]})")
    results = {"command": command_line("benchmarks.prefill_dtypes", argv), "machine": machine_info(),
               "prompt_tok_per_s": rates, "median": medians, "ratio_to_first": ratios}
    write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
