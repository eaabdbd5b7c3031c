"""Speculative decoding under arriving traffic: chat requests arriving at random (Poisson) times at a few rates, with
speculation against without, in one process, so that the batch size moves around the speculating limit
(max_batch_size) as it does behind a server.

Each run sends --requests chat prompts of uneven length (benchmarks.workloads) with long-tailed output limits
(16-256 tokens, 64 on average; greedy, stopping at the end of the answer or the limit) into an `Engine` driven step
by step, adding each request when its arrival time has come. Per setting and rate: the mean and median end-to-end
latency (arrival to last token), the mean time per output token after the first (TPOT), the mean time to the first
token, and output tokens per second over the run. Each round draws new prompts and new arrival times, the same for
both settings; the settings' order is reversed every other round. A setting's figures sum its rounds, and the
ratios compare speculation against none (latency: off / on, so above 1 is faster).

    python -m benchmarks.spec_arrivals --rates 1,2,4 --rounds 4
    python -m benchmarks.spec_arrivals --method suffix --json benchmarks/results/spec_arrivals_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.spec_decode import SETTINGS


def serve(engine, prompts: list[list[int]], limits: list[int], arrivals: list[float]) -> dict:
    """Add request i at `arrivals[i]` seconds from now, step the engine until every request has finished;
    -> per request (arrival, first token, finish, output tokens) in seconds from the start, and the drafts verified."""
    from jvllm import SamplingParams

    verified_before = engine.drafter.stats.num_drafts if engine.drafter is not None else 0
    started = time.perf_counter()
    first: dict[int, float] = {}
    done: dict[int, tuple[float, int]] = {}
    added = 0
    while len(done) < len(prompts):
        now = time.perf_counter() - started
        while added < len(prompts) and arrivals[added] <= now:
            engine.add_request(str(added), {"prompt_token_ids": prompts[added]},
                               SamplingParams(temperature=0.0, max_tokens=limits[added]))
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        for out in engine.step():
            index, at = int(out.request_id), time.perf_counter() - started
            if out.outputs[0].token_ids and index not in first:
                first[index] = at
            if out.finished:
                done[index] = (at, len(out.outputs[0].token_ids))
    verified = (engine.drafter.stats.num_drafts if engine.drafter is not None else 0) - verified_before
    return {"requests": [(arrivals[i], first[i], *done[i]) for i in range(len(prompts))], "verification_steps": verified}


def summarize(runs: list[dict]) -> dict:
    """Latency and throughput over the requests of `runs` (seconds, tokens/s)."""
    requests = [r for run in runs for r in run["requests"]]
    latency = [finish - arrival for arrival, _, finish, _ in requests]
    tpot = [(finish - first) / (n - 1) for _, first, finish, n in requests if n > 1]
    tokens = sum(n for *_, n in requests)
    span = sum(max(r[2] for r in run["requests"]) - min(r[0] for r in run["requests"]) for run in runs)
    return {"latency_mean_s": statistics.fmean(latency), "latency_p50_s": statistics.median(latency),
            "tpot_mean_ms": 1e3 * statistics.fmean(tpot),
            "ttft_mean_s": statistics.fmean(first - arrival for arrival, first, _, _ in requests),
            "output_tok_s": tokens / span, "output_tokens": tokens,
            "verification_steps": sum(run["verification_steps"] for run in runs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1,2,4", help="arrival rates, requests per second")
    parser.add_argument("--requests", type=int, default=40, help="requests per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", choices=["ngram", "suffix"], default="ngram")
    parser.add_argument("--config", action="append", default=None, metavar="JSON",
                        help="fields that replace the method's speculative_config ones, e.g. '{\"max_batch_size\": 2}' "
                             "(repeatable: one speculating engine each, beside the one without)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    from jvllm import LLM
    from benchmarks import workloads

    rates = [float(r) for r in args.rates.split(",")]
    changes = [json.loads(text) for text in args.config] if args.config else [{}]
    configs = {args.method + (f" {json.dumps(change)}" if change else ""): {**SETTINGS[args.method], **change}
               for change in changes}
    engines = {"off": LLM(), **{name: LLM(speculative_config=config) for name, config in configs.items()}}
    tokenizer = engines["off"].get_tokenizer()
    warm = workloads.chat_varied(tokenizer, 8, 8 * 64, seed=999)
    for engine in engines.values():  # every step shape a run needs, on prompts no run sends
        serve(engine, warm.prompts, warm.output_lens, [0.0] * len(warm.prompts))
    runs: dict[tuple[float, str], list[dict]] = {(rate, name): [] for rate in rates for name in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for rate in rates:
            seed = 1000 * round_index + int(10 * rate)
            load = workloads.chat_varied(tokenizer, args.requests, 64 * args.requests, seed=seed)
            arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, args.requests)).tolist()
            line = []
            for name in order:
                engines[name].reset_prefix_cache()
                run = serve(engines[name], load.prompts, load.output_lens, arrivals)
                runs[rate, name].append(run)
                got = summarize([run])
                line.append(f"{name}: {got['latency_mean_s']:.2f} s, TPOT {got['tpot_mean_ms']:.1f} ms, "
                            f"{got['verification_steps']} verifying")
            print(f"round {round_index + 1} rate {rate:g}/s: mean latency " + "; ".join(line), flush=True)
    table: dict[float, dict] = {}
    for rate in rates:
        off = summarize(runs[rate, "off"])
        table[rate] = {"off": off}
        for name in configs:
            on = summarize(runs[rate, name])
            table[rate][name] = {**on, "latency_ratio": off["latency_mean_s"] / on["latency_mean_s"],
                                 "tpot_ratio": off["tpot_mean_ms"] / on["tpot_mean_ms"],
                                 "throughput_ratio": on["output_tok_s"] / off["output_tok_s"]}
            row = table[rate][name]
            print(f"rate {rate:g}/s, {name}: mean latency {off['latency_mean_s']:.2f} -> {on['latency_mean_s']:.2f} s "
                  f"({row['latency_ratio']:.2f}x); TPOT {off['tpot_mean_ms']:.1f} -> {on['tpot_mean_ms']:.1f} ms "
                  f"({row['tpot_ratio']:.2f}x); output tok/s {off['output_tok_s']:.0f} -> {on['output_tok_s']:.0f}; "
                  f"{on['verification_steps']} verification steps")
    if args.json:
        write_json(args.json, {"command": command_line("benchmarks.spec_arrivals", argv), "machine": machine_info(),
                               "speculative_configs": configs, "requests_per_run": args.requests,
                               "rounds": args.rounds, "rates": {str(rate): row for rate, row in table.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
