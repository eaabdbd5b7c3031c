"""`jvllm bench throughput` (every request at once through `LLM.generate`) and `jvllm bench latency` (one batch,
timed end to end, several times), on an engine built from the engine flags."""
from __future__ import annotations

import argparse
import time

import numpy as np

from entrypoints.bench.datasets import build_requests
from entrypoints.bench.report import PERCENTILES, print_table, save


def _engine(args: argparse.Namespace):
    from jvllm import Engine
    from jvllm.engine.arg_utils import EngineArgs

    return Engine.from_engine_args(EngineArgs.from_cli_args(args))


def _params(output_len: int, args: argparse.Namespace):
    from jvllm import SamplingParams

    # vLLM's bench: every request generates exactly its output length
    return SamplingParams(temperature=args.temperature, max_tokens=output_len, ignore_eos=True)


def run_throughput(args: argparse.Namespace) -> int:
    engine = _engine(args)
    requests = build_requests(args, engine.get_tokenizer(), engine.model.config.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    params = [_params(r.output_len, args) for r in requests]
    started = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - started
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {"elapsed_time": elapsed, "num_requests": len(requests), "total_num_tokens": prompt_tokens + output_tokens,
               "total_output_tokens": output_tokens, "requests_per_second": len(requests) / elapsed,
               "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
               "output_tokens_per_second": output_tokens / elapsed}
    print(f"Throughput: {results['requests_per_second']:.2f} requests/s, {results['tokens_per_second']:.2f} total "
          f"tokens/s, {results['output_tokens_per_second']:.2f} output tokens/s")
    save(results, args.output_json)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    engine = _engine(args)
    args.num_prompts = args.batch_size
    requests = build_requests(args, engine.get_tokenizer(), engine.model.config.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    params = [_params(r.output_len, args) for r in requests]

    def once() -> float:
        started = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in range(args.num_iters_warmup):
        once()
    latencies = [once() for _ in range(args.num_iters)]
    results = {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
               "percentiles": {str(p): float(np.percentile(latencies, p)) for p in (10, 25, *PERCENTILES)}}
    print_table("Latency", [("Batch size", args.batch_size), ("Iterations", args.num_iters),
                            ("Avg latency (s)", results["avg_latency"]),
                            *[(f"P{p} latency (s)", float(results["percentiles"][str(p)])) for p in PERCENTILES]])
    save(results, args.output_json)
    return 0
