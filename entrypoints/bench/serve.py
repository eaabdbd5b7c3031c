"""`jvllm bench serve`: streams completions to any OpenAI-compatible server (jvllm, vLLM, llama.cpp) at a request
rate, and reports throughput and TTFT / TPOT / ITL / E2E latency percentiles (vLLM's names and result keys)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import time
from typing import Any

import numpy as np

from entrypoints.bench.datasets import BenchRequest, build_requests
from entrypoints.bench.report import distribution, print_table, save

# Seconds a client keeps an idle connection for reuse: below any server's keep-alive (vLLM's and uvicorn's default:
# 5 s), since a request sent on a connection the server is closing at that moment fails with "Server disconnected".
CLIENT_KEEPALIVE_S = 2.0


def _tokenizer(name: str | None) -> Any:
    """The prompts' tokenizer: a HF folder or a .gguf file, default the embedded model's."""
    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.gguf import gguf_tokenizer

    path = name or default_model_path()
    if path.endswith(".gguf"):
        return gguf_tokenizer(path)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


async def _one(session: Any, url: str, headers: dict, model: str, request: BenchRequest) -> dict:
    """One streamed completion -> its send time, token chunk times, end time, tokens and error (if any)."""
    body = {"model": model, "prompt": request.prompt_ids, "max_tokens": request.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunks: list[float] = []
    tokens, error = 0, None
    try:
        async with session.post(url, json=body, headers=headers) as reply:
            if reply.status != 200:
                error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
            else:
                async for raw in reply.content:  # one SSE line at a time
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and event["choices"][0].get("text"):
                        chunks.append(time.perf_counter())
    except Exception as failure:  # connection refused or reset: counted, not fatal to the run
        error = f"{type(failure).__name__}: {failure}"
    return {"sent": sent, "chunks": chunks, "done": time.perf_counter(), "tokens": tokens or len(chunks),
            "prompt_len": len(request.prompt_ids), "error": error}


async def _drive(args: argparse.Namespace, url: str, model: str, requests: list[BenchRequest]) -> tuple[list, float]:
    import aiohttp
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    rng = np.random.default_rng(args.seed)
    progress = tqdm(total=len(requests), unit="req", disable=args.disable_tqdm)
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def gated(request: BenchRequest) -> dict:
            async with gate:
                result = await _one(session, url, headers, model, request)
            progress.update(1)
            return result

        tasks = []
        started = time.perf_counter()
        for request in requests:  # Poisson arrivals at --request-rate (inf: all at once)
            tasks.append(asyncio.create_task(gated(request)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    progress.close()
    return results, elapsed


def _served_model(base: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def summarize(results: list[dict], elapsed: float) -> dict:
    """vLLM's result keys: counts, throughputs, and mean / median / p90 / p99 of TTFT, TPOT, ITL and E2E."""
    done = [r for r in results if r["error"] is None]
    ttft = [r["chunks"][0] - r["sent"] for r in done if r["chunks"]]
    tpot = [(r["done"] - r["chunks"][0]) / (r["tokens"] - 1) for r in done if r["chunks"] and r["tokens"] > 1]
    itl = [later - earlier for r in done for earlier, later in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["done"] - r["sent"] for r in done]
    output_tokens = sum(r["tokens"] for r in done)
    input_tokens = sum(r["prompt_len"] for r in done)
    summary = {"duration": elapsed, "completed": len(done), "failed": len(results) - len(done),
               "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
               "request_throughput": len(done) / elapsed, "output_throughput": output_tokens / elapsed,
               "total_token_throughput": (input_tokens + output_tokens) / elapsed,
               "errors": sorted({r["error"] for r in results if r["error"]})[:5]}
    for values, name in ((ttft, "ttft"), (tpot, "tpot"), (itl, "itl"), (e2e, "e2el")):
        summary.update(distribution(values, name))
    return summary


def run_serve_bench(args: argparse.Namespace) -> int:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model or _served_model(base, args.api_key)
    tokenizer = _tokenizer(args.tokenizer)
    requests = build_requests(args, tokenizer, len(tokenizer))
    results, elapsed = asyncio.run(_drive(args, f"{base}{args.endpoint}", model, requests))
    summary = summarize(results, elapsed)
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", summary["duration"]), ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows += [(f"{kind} {title} (ms)", summary[f"{key}_{name}_ms"])
                 for kind, key in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))]
    print_table("Serving Benchmark Result", rows)
    for error in summary["errors"]:
        print(f"error: {error}")
    summary.update({"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": base, "model_id": model,
                    "endpoint": args.endpoint, "request_rate": args.request_rate,
                    "max_concurrency": args.max_concurrency, "num_prompts": len(requests),
                    "dataset_name": args.dataset_name})
    if args.save_result or args.result_filename:
        name = args.result_filename or (f"jvllm-bench-serve-{args.request_rate}qps-{model.replace('/', '-')}-"
                                        f"{summary['date']}.json")
        save(summary, os.path.join(args.result_dir or ".", name))
    return 0 if summary["completed"] else 1
