"""Shared-prefix workload with the prefix cache on and off, in the same run: one long system prompt, many
different user turns. Prints mean/p50 time to first token, total time, and the cache-on speedup."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from benchmarks.common import command_line, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_prompts(tokenizer, system_tokens: int, num_users: int) -> list[dict]:
    sentence = "Follow the house rules: be concise, cite the rule you applied, and ask before assuming. "
    system = tokenizer.encode(sentence * (system_tokens // 12 + 1))[:system_tokens]
    return [{"prompt_token_ids": system + tokenizer.encode(f" User {i}: what is {i} squared plus {i + 3}?")}
            for i in range(num_users)]


def run(engine, prompts: list[dict], output_len: int) -> dict:
    from jvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - started
    ttft = np.array([o.metrics.first_token_time - o.metrics.arrival_time for o in outputs])
    return {"total_seconds": total, "mean_ttft_seconds": float(ttft.mean()), "p50_ttft_seconds": float(np.median(ttft)),
            "p99_ttft_seconds": float(np.percentile(ttft, 99)),
            "mean_cached_tokens": float(np.mean([o.num_cached_tokens for o in outputs]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--num-users", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30,
                        help="pool size; the default holds all 64 SmolLM2 requests without the cache, so the cache-off "
                             "run measures recomputation, not preemption")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from jvllm import Engine

    results: dict = {"command": command_line("benchmarks.prefix_cache", argv), "machine": machine_info(),
                     "system_tokens": args.system_tokens, "num_users": args.num_users, "output_len": args.output_len}
    for label, caching in (("cache_off", False), ("cache_on", True)):
        engine = Engine(args.model, max_num_seqs=args.num_users, enable_prefix_caching=caching,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes, batched_weight_dtype="bfloat16")
        prompts = build_prompts(engine.get_tokenizer(), args.system_tokens, args.num_users)
        run(engine, prompts, args.output_len)  # warm-up: compiles every shape the timed run needs
        results[label] = run(engine, prompts, args.output_len)
        r = results[label]
        print(f"[{label}] total {r['total_seconds']:.2f}s, mean TTFT {r['mean_ttft_seconds']:.2f}s "
              f"(p50 {r['p50_ttft_seconds']:.2f}s), mean cached tokens {r['mean_cached_tokens']:.0f}", flush=True)
        del engine
    speedup = results["cache_off"]["mean_ttft_seconds"] / results["cache_on"]["mean_ttft_seconds"]
    results["mean_ttft_speedup"] = speedup
    results["total_speedup"] = results["cache_off"]["total_seconds"] / results["cache_on"]["total_seconds"]
    print(f"prefix cache: mean TTFT {speedup:.1f}x lower, total time {results['total_speedup']:.1f}x lower")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
