"""Serving benchmark: N concurrent streaming clients over HTTP vs offline Engine.generate, in the same run.

The engine and the uvicorn server run in this process (the server in a thread); the clients run in a
separate process (aiohttp, asyncio; benchmarks/serve_client.py) so that they do not compete with the
server for the GIL, as with vLLM's `bench serve`. Prompts are random token ids (fixed lengths, or uniform
within --range-ratio), sent to /v1/completions with ignore_eos, so every request makes exactly its output
length. Reported: request throughput, output tokens/s, TTFT, TPOT, ITL and end-to-end latency (mean,
p50, p99); offline Engine.generate output tokens/s on the same prompts and the ratio; and the TTFT
overhead, TTFT minus the engine's own time to first token (arrival at the HTTP handler to first sampled
token, from RequestOutput.metrics), measured two ways:
- server-side: from the moment uvicorn hands the request to the app to the moment the app hands it the
  first token's chunk (timed by an ASGI wrapper around the app), minus the engine's TTFT;
- end to end: the client's TTFT minus the engine's TTFT, which adds the client's own work and the
  loopback TCP on both ways, split into client send -> handler and first token -> client.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.serve_client import run_clients

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean, p50 and p99 (in ms by default) of `values`."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] * scale

    return {"mean": statistics.fmean(values) * scale, "p50": pct(0.50), "p99": pct(0.99)}


# ---- the server and the engine (this process) -----------------------------------------------------
class _EngineTTFT:
    """Observer: each request's engine-side time to first token (arrival at the handler -> first token)."""

    def __init__(self) -> None:
        self.wall: dict[str, tuple[float, float]] = {}  # (arrival, first token), time.time()

    def __call__(self, output) -> None:
        metrics = output.metrics
        if output.request_id not in self.wall and metrics and metrics.first_token_time is not None:
            self.wall[output.request_id] = (metrics.arrival_time, metrics.first_token_time)


class _ServerTimes:
    """ASGI wrapper: per completion id, when uvicorn handed the request to the app and when the app sent
    the first body chunk (the first token: chunks without text are never sent first), as time.time()."""

    def __init__(self, app) -> None:
        self.app = app
        self.times: dict[str, tuple[float, float]] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        entered = time.time()
        first_seen = False

        async def timed_send(message) -> None:
            nonlocal first_seen
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if not first_seen and body.startswith(b"data: {"):
                first_seen = True
                self.times[json.loads(body[6:])["id"]] = (entered, time.time())
            await send(message)

        await self.app(scope, receive, timed_send)


def start_server(engine, model: str):
    import uvicorn

    from jvllm.engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.serve import GIL_SWITCH_INTERVAL_S, uvicorn_config
    from server.settings import ServerSettings

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as `jvllm serve` does
    async_engine = AsyncEngine(engine, max_waiting_requests=None)
    recorder = _EngineTTFT()
    async_engine.observers.append(recorder)
    settings = ServerSettings([model], log_level="warning", disable_access_log=True)
    app = _ServerTimes(build_app(async_engine, settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, settings))  # as `jvllm serve` configures it
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread, recorder, app


def summarize(run: dict, recorder: _EngineTTFT, server_times: dict[str, tuple[float, float]]) -> dict:
    requests = run["requests"]
    ttft, tpot, itl, e2e, engine_ttft = [], [], [], [], []
    overhead = {key: [] for key in ("server", "end_to_end", "inbound", "asgi_to_handler", "outbound_server",
                                    "outbound")}
    for r in requests:
        if not r["chunks"]:
            continue
        first = r["chunks"][0] - r["sent"]
        ttft.append(first)
        e2e.append(r["done"] - r["sent"])
        if r["tokens"] > 1:
            tpot.append((r["done"] - r["chunks"][0]) / (r["tokens"] - 1))
        itl.extend(b - a for a, b in zip(r["chunks"], r["chunks"][1:]))
        wall = recorder.wall.get(f"{r['id']}-0")
        if wall is None or r["id"] not in server_times:
            continue
        arrival, first_token = wall  # same machine: the server's and the client's wall clocks agree
        engine_first = first_token - arrival
        engine_ttft.append(engine_first)
        entered, first_sent = server_times[r["id"]]
        overhead["server"].append(first_sent - entered - engine_first)
        overhead["end_to_end"].append(first - engine_first)
        overhead["inbound"].append(arrival - r["sent_wall"])
        overhead["asgi_to_handler"].append(arrival - entered)
        overhead["outbound_server"].append(first_sent - first_token)
        overhead["outbound"].append(r["first_wall"] - first_token)
    tokens = sum(r["tokens"] for r in requests)
    return {"seconds": run["seconds"], "completed": len(requests), "output_tokens": tokens,
            "requests_per_s": len(requests) / run["seconds"], "output_tokens_per_s": tokens / run["seconds"],
            "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e),
            "engine_ttft_ms": _stats(engine_ttft),
            **{f"ttft_overhead_{key}_ms": _stats(values) for key, values in overhead.items()}}


def offline(engine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from jvllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    started = time.perf_counter()
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds, "output_tokens_per_s": tokens / seconds}


def workload(num: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int, varied: bool = False):
    """(prompts, output lengths): lengths uniform within len*(1 +- ratio), or with `varied` long-tailed (prompts
    16-1,024 tokens, outputs 16-256) with the same totals (benchmarks.workloads.varied)."""
    import numpy as np

    from benchmarks import workloads

    if varied:
        mix = workloads.varied(num, num * input_len, num * output_len, vocab, seed)
        return mix.prompts, mix.output_lens
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> list[int]:
        low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
        return rng.integers(low, high + 1, size=num).tolist()

    prompts = [rng.integers(100, vocab - 100, size=n).tolist() for n in lengths(input_len)]
    return prompts, lengths(output_len)


_LATENCY_ROWS = (
    ("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"), ("engine TTFT", "engine_ttft_ms"),
    ("TTFT overhead, server-side (ASGI in -> first chunk out, minus engine TTFT)", "ttft_overhead_server_ms"),
    ("- of which ASGI in -> handler", "ttft_overhead_asgi_to_handler_ms"),
    ("- of which first token -> chunk out", "ttft_overhead_outbound_server_ms"),
    ("TTFT overhead, end to end (client TTFT minus engine TTFT)", "ttft_overhead_end_to_end_ms"),
    ("- of which client send -> handler", "ttft_overhead_inbound_ms"),
    ("- of which first token -> client", "ttft_overhead_outbound_ms"),
)


def markdown(results: dict) -> str:
    s, o = results["serve"], results["offline"]
    rows = [f"| {name} | {s[key]['mean']:.1f} | {s[key]['p50']:.1f} | {s[key]['p99']:.1f} |"
            for name, key in _LATENCY_ROWS if s[key]["mean"] is not None]
    return "\n".join([
        f"# Serving benchmark ({results['machine']['backend']})", "",
        f"- Command: `{results['command']}`",
        f"- Model: {results['model']}; {results['num_prompts']} prompts, {results['concurrency']} concurrent streams, "
        f"input {results['input_len']} / output {results['output_len']} tokens (range ratio "
        f"{results['range_ratio']}{', varied' if results.get('varied') else ''})",
        f"- Machine: {results['machine']['platform']}, {results['machine']['cpus']} CPUs, "
        f"jax {results['machine']['jax']}",
        "", "| throughput | HTTP (streaming) | offline Engine.generate | ratio |", "|---|---|---|---|",
        f"| output tok/s | {s['output_tokens_per_s']:.1f} | {o['output_tokens_per_s']:.1f} (mean of "
        f"{' and '.join(f'{x:.1f}' for x in o['runs_output_tokens_per_s'])}, before and after) | "
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
    parser.add_argument("--varied", action="store_true",
                        help="long-tailed lengths (prompts 16-1024, outputs 16-256) with the same totals")
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
    prompts, lens = workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, seed=0,
                             varied=args.varied)
    warm_prompts, warm_lens = workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab,
                                       seed=1, varied=args.varied)
    offline(engine, warm_prompts, warm_lens)  # a warm-up on other prompts of the same kind
    offline_before = offline(engine, prompts, lens)
    print(f"[offline] {offline_before['output_tokens_per_s']:.1f} output tok/s", flush=True)
    url, server, thread, recorder, timed_app = start_server(engine, model)
    try:  # the warm-up pass compiles the shapes of staggered arrivals; the timed pass reuses its connections
        _, timed_run = run_clients(url, [(warm_prompts, warm_lens), (prompts, lens)], args.concurrency, model)
        serve_result = summarize(timed_run, recorder, timed_app.times)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    # Offline runs on both sides of the HTTP run: this VM's speed drifts by tens of percent within minutes,
    # so the baseline is their mean, not one sample that may have caught a fast or a slow moment.
    offline_after = offline(engine, prompts, lens)
    print(f"[offline] {offline_after['output_tokens_per_s']:.1f} output tok/s (after the HTTP run)", flush=True)
    offline_result = {key: (offline_before[key] + offline_after[key]) / 2 for key in offline_before}
    offline_result["runs_output_tokens_per_s"] = [offline_before["output_tokens_per_s"],
                                                  offline_after["output_tokens_per_s"]]
    ratio = serve_result["output_tokens_per_s"] / offline_result["output_tokens_per_s"]
    results = {
        "command": command_line("benchmarks.serve", argv), "machine": machine_info(),
        "model": model, "num_prompts": args.num_prompts, "concurrency": args.concurrency,
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio, "varied": args.varied,
        "max_num_seqs": engine.config.max_num_seqs, "prefix_caching": args.enable_prefix_caching,
        "offline": offline_result, "serve": serve_result, "http_over_offline": ratio,
    }
    s = serve_result
    print(f"[serve] {s['output_tokens_per_s']:.1f} output tok/s ({100 * ratio:.0f}% of offline), "
          f"{s['requests_per_s']:.2f} req/s", flush=True)
    for label, name in _LATENCY_ROWS:
        st = s[name]
        if st["mean"] is not None:
            print(f"[serve] {label[:60]:60s} mean {st['mean']:8.1f}  p50 {st['p50']:8.1f}  p99 {st['p99']:8.1f}")
    write_json(args.json, results)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
