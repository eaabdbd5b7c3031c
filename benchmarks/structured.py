"""Structured decoding cost: output tok/s of 32 JSON-schema chat requests against the same 32 unconstrained.

The unconstrained pass generates exactly as many tokens per request as its constrained twin wrote (ignore_eos), so
both passes run the same steps (the prefix cache is emptied before each pass); the difference is the grammar work (masks on the host, the masked sampler on the
device) and the loss of async scheduling for constrained rows. Each pass is preceded by a warm-up pass of the same
kind on other prompts; every timed pass is a first pass over its prompts.

    python -m benchmarks.structured [--repeats 3] [--json benchmarks/results/structured_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.json_schemas import SCHEMAS

ASKS = ["Reply with {} as JSON.", "Give me {} in JSON form.", "Write {} as a JSON value.", "Output {} as JSON only.",
        "As JSON, describe {}."]


def _conversations(round_index: int) -> list[list[dict]]:
    ask = ASKS[round_index % len(ASKS)]
    return [[{"role": "user", "content": ask.format(what)}] for what, _ in SCHEMAS]


def constrained_pass(engine, round_index: int) -> tuple[float, list[int]]:
    """-> (seconds, output length of each request)."""
    from jvllm import SamplingParams, StructuredOutputsParams

    params = [SamplingParams(temperature=0.0, max_tokens=256, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in SCHEMAS]
    engine.reset_prefix_cache()  # both passes prefill their prompts in full
    started = time.perf_counter()
    outputs = engine.chat(_conversations(round_index), params, use_tqdm=False)
    return time.perf_counter() - started, [len(o.outputs[0].token_ids) for o in outputs]


def free_pass(engine, round_index: int, lengths: list[int]) -> float:
    from jvllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = engine.chat(_conversations(round_index), params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)

    from jvllm import Engine

    engine = Engine()
    _, warm_lengths = constrained_pass(engine, 0)
    free_pass(engine, 0, warm_lengths)
    rounds = []
    for index in range(1, args.repeats + 1):
        constrained_s, lengths = constrained_pass(engine, index)
        free_s = free_pass(engine, index, lengths)
        tokens = sum(lengths)
        rounds.append({"output_tokens": tokens, "constrained_s": constrained_s, "unconstrained_s": free_s,
                       "constrained_tok_s": tokens / constrained_s, "unconstrained_tok_s": tokens / free_s})
        print(f"round {index}: {tokens} output tokens; constrained {tokens / constrained_s:.1f} tok/s, "
              f"unconstrained {tokens / free_s:.1f} tok/s, ratio {free_s / constrained_s:.3f}")
    ratio = statistics.median(r["unconstrained_s"] / r["constrained_s"] for r in rounds)
    summary = {"requests": len(SCHEMAS), "rounds": rounds, "median_constrained_over_unconstrained": ratio,
               "median_constrained_tok_s": statistics.median(r["constrained_tok_s"] for r in rounds),
               "median_unconstrained_tok_s": statistics.median(r["unconstrained_tok_s"] for r in rounds)}
    print(f"structured decoding: {summary['median_constrained_tok_s']:.1f} tok/s vs "
          f"{summary['median_unconstrained_tok_s']:.1f} tok/s unconstrained (same run): ratio {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(summary, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
