"""Serving benchmark: N concurrent streaming clients over HTTP vs offline Engine.generate, in the same run.

The engine and the uvicorn server run in this process (the server in a thread); the clients run in a
separate process (httpx, asyncio) so that they do not compete with the server for the GIL, as with
vLLM's `bench serve`. Prompts are random token ids (fixed lengths, or uniform within
--range-ratio), sent to /v1/completions with ignore_eos, so every request makes exactly its output
length. Reported: request throughput, output tokens/s, TTFT, TPOT, ITL and end-to-end latency (mean,
p50, p99); offline Engine.generate output tokens/s on the same prompts and the ratio; and the
server-side TTFT overhead: client TTFT minus the engine's own time to first token (arrival at the
HTTP handler to first sampled token, from RequestOutput.metrics).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time

from benchmarks.common import command_line, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean, p50 and p99 (in ms by default) of `values`."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] * scale

    return {"mean": statistics.fmean(values) * scale, "p50": pct(0.50), "p99": pct(0.99)}


# ---- the client process (no jax import here) ------------------------------------------------------
async def _one(client, url: str, prompt: list[int], output_len: int, model: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, sent_wall = time.perf_counter(), time.time()
    chunk_times: list[float] = []
    first_wall = None
    request_id, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            request_id = request_id or event["id"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
                first_wall = first_wall or time.time()
    done = time.perf_counter()
    return {"id": request_id, "sent": sent, "chunks": chunk_times, "done": done, "tokens": tokens,
            "sent_wall": sent_wall, "first_wall": first_wall}


async def _drive(url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int, model: str) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def gated(prompt: list[int], length: int) -> dict:
            async with gate:
                return await _one(client, url, prompt, length, model)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(p, n) for p, n in zip(prompts, output_lens)))
        return {"seconds": time.perf_counter() - started, "requests": results}


def _client_main(url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int, model: str,
                 queue) -> None:
    queue.put(asyncio.run(_drive(url, prompts, output_lens, concurrency, model)))


def run_clients(url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int, model: str) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_client_main, args=(url, prompts, output_lens, concurrency, model, queue))
    process.start()
    while True:  # a client process that dies (e.g. an HTTP error) must fail the benchmark, not hang it
        try:
            result = queue.get(timeout=1.0)
            break
        except Exception:  # queue.Empty
            if not process.is_alive():
                raise RuntimeError(f"the client process exited with code {process.exitcode} before reporting")
    process.join()
    return result


# ---- the server and the engine (this process) -----------------------------------------------------
class _EngineTTFT:
    """Observer: each request's engine-side time to first token (arrival at the handler -> first token)."""

    def __init__(self) -> None:
        self.ttft: dict[str, float] = {}
        self.wall: dict[str, tuple[float, float]] = {}  # (arrival, first token), time.time()

    def __call__(self, output) -> None:
        metrics = output.metrics
        if output.request_id not in self.ttft and metrics and metrics.time_to_first_token is not None:
            self.ttft[output.request_id] = metrics.time_to_first_token
            self.wall[output.request_id] = (metrics.arrival_time, metrics.first_token_time)


def start_server(engine, model: str):
    import uvicorn

    from jvllm.async_engine import AsyncEngine
    from server.app import build_app
    from server.serve import GIL_SWITCH_INTERVAL_S
    from server.settings import ServerSettings

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as `jvllm serve` does
    async_engine = AsyncEngine(engine, max_waiting_requests=None)
    recorder = _EngineTTFT()
    async_engine.observers.append(recorder)
    app = build_app(async_engine, ServerSettings([model]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread, recorder


def summarize(run: dict, recorder: _EngineTTFT) -> dict:
    requests, engine_ttft = run["requests"], recorder.ttft
    ttft, tpot, itl, e2e, overhead, inbound, outbound = [], [], [], [], [], [], []
    for r in requests:
        if not r["chunks"]:
            continue
        first = r["chunks"][0] - r["sent"]
        ttft.append(first)
        e2e.append(r["done"] - r["sent"])
        if r["tokens"] > 1:
            tpot.append((r["done"] - r["chunks"][0]) / (r["tokens"] - 1))
        itl.extend(b - a for a, b in zip(r["chunks"], r["chunks"][1:]))
        engine_first = engine_ttft.get(f"{r['id']}-0")
        if engine_first is not None:
            overhead.append(first - engine_first)
            arrival, first_token = recorder.wall[f"{r['id']}-0"]  # same machine: wall clocks agree
            inbound.append(arrival - r["sent_wall"])
            outbound.append(r["first_wall"] - first_token)
    tokens = sum(r["tokens"] for r in requests)
    return {"seconds": run["seconds"], "completed": len(requests), "output_tokens": tokens,
            "requests_per_s": len(requests) / run["seconds"], "output_tokens_per_s": tokens / run["seconds"],
            "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e),
            "server_ttft_overhead_ms": _stats(overhead), "engine_ttft_ms": _stats(list(engine_ttft.values())),
            "overhead_request_to_handler_ms": _stats(inbound), "overhead_first_token_to_client_ms": _stats(outbound)}


def offline(engine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from jvllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    started = time.perf_counter()
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds, "output_tokens_per_s": tokens / seconds}


def workload(num: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> list[int]:
        low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
        return rng.integers(low, high + 1, size=num).tolist()

    prompts = [rng.integers(100, vocab - 100, size=n).tolist() for n in lengths(input_len)]
    return prompts, lengths(output_len)


def markdown(results: dict) -> str:
    s, o = results["serve"], results["offline"]
    rows = [f"| {name} | {s[key]['mean']:.1f} | {s[key]['p50']:.1f} | {s[key]['p99']:.1f} |"
            for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"),
                              ("server TTFT overhead", "server_ttft_overhead_ms"), ("engine TTFT", "engine_ttft_ms"),
                              ("overhead: request -> handler", "overhead_request_to_handler_ms"),
                              ("overhead: first token -> client", "overhead_first_token_to_client_ms"))
            if s[key]["mean"] is not None]
    return "\n".join([
        f"# Serving benchmark ({results['machine']['backend']})", "",
        f"- Command: `{results['command']}`",
        f"- Model: {results['model']}; {results['num_prompts']} prompts, {results['concurrency']} concurrent streams, "
        f"input {results['input_len']} / output {results['output_len']} tokens (range ratio {results['range_ratio']})",
        f"- Machine: {results['machine']['platform']}, {results['machine']['cpus']} CPUs, "
        f"jax {results['machine']['jax']}",
        "", "| throughput | HTTP (streaming) | offline Engine.generate | ratio |", "|---|---|---|---|",
        f"| output tok/s | {s['output_tokens_per_s']:.1f} | {o['output_tokens_per_s']:.1f} | "
        f"{results['http_over_offline']:.2f} |",
        f"| requests/s | {s['requests_per_s']:.2f} | {o['requests_per_s']:.2f} | |",
        "", "| latency (ms) | mean | p50 | p99 |", "|---|---|---|---|", *rows, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batched-weight-dtype", default="bfloat16", help="'none' keeps one float32 copy")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight at once")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: --concurrency (same for both)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="off by default: warm-up and timed runs would share prompts' pages")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--markdown", default=None, help="write a results table here")
    args = parser.parse_args(argv)

    from jvllm import Engine

    engine = Engine(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs or args.concurrency,
                    max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                    enable_prefix_caching=args.enable_prefix_caching,
                    batched_weight_dtype=None if args.batched_weight_dtype == "none" else args.batched_weight_dtype)
    vocab = engine.model.config.vocab_size
    model = engine.served_model_name
    prompts, lens = workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, seed=0)
    warm_prompts, warm_lens = workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab,
                                       seed=1)
    offline(engine, warm_prompts, warm_lens)  # compiles the shapes of this workload
    offline_result = offline(engine, prompts, lens)
    print(f"[offline] {offline_result['output_tokens_per_s']:.1f} output tok/s", flush=True)
    url, server, thread, recorder = start_server(engine, model)
    try:
        run_clients(url, warm_prompts, warm_lens, args.concurrency, model)  # shapes of staggered arrivals
        recorder.ttft.clear()
        recorder.wall.clear()
        serve_result = summarize(run_clients(url, prompts, lens, args.concurrency, model), recorder)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    ratio = serve_result["output_tokens_per_s"] / offline_result["output_tokens_per_s"]
    results = {
        "command": command_line("benchmarks.serve", argv), "machine": machine_info(),
        "model": model, "num_prompts": args.num_prompts, "concurrency": args.concurrency,
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        "max_num_seqs": engine.config.max_num_seqs, "prefix_caching": args.enable_prefix_caching,
        "offline": offline_result, "serve": serve_result, "http_over_offline": ratio,
    }
    s = serve_result
    print(f"[serve] {s['output_tokens_per_s']:.1f} output tok/s ({100 * ratio:.0f}% of offline), "
          f"{s['requests_per_s']:.2f} req/s", flush=True)
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "server_ttft_overhead_ms", "engine_ttft_ms",
                 "overhead_request_to_handler_ms", "overhead_first_token_to_client_ms"):
        st = s[name]
        if st["mean"] is not None:
            print(f"[serve] {name:24s} mean {st['mean']:8.1f}  p50 {st['p50']:8.1f}  p99 {st['p99']:8.1f}")
    write_json(args.json, results)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
