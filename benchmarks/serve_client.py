"""The serving benchmark's client process: N concurrent streaming /v1/completions requests (aiohttp, no jax).

aiohttp is what vLLM's `bench serve` uses; its per-request cost is well below httpx's, and on a 2-core
machine every millisecond the client spends is a millisecond the server waits for the CPU. One process
runs the warm-up pass and then the timed pass on the same connection pool, as a long-lived client would.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue as queue_module
import time


async def _one(session, url: str, prompt: list[int], output_len: int, model: str) -> dict:
    """One streamed completion; -> its id, send time, per-token chunk times, end time and token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, sent_wall = time.perf_counter(), time.time()
    chunk_times: list[float] = []
    first_wall = None
    request_id, tokens = None, 0
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
        async for raw in reply.content:  # one SSE line at a time
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            request_id = request_id or event["id"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
                first_wall = first_wall or time.time()
    return {"id": request_id, "sent": sent, "chunks": chunk_times, "done": time.perf_counter(), "tokens": tokens,
            "sent_wall": sent_wall, "first_wall": first_wall}


async def _pass(session, url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int,
                model: str) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int], length: int) -> dict:
        async with gate:
            return await _one(session, url, prompt, length, model)

    started = time.perf_counter()
    results = await asyncio.gather(*(gated(p, n) for p, n in zip(prompts, output_lens)))
    return {"seconds": time.perf_counter() - started, "requests": results}


async def _drive(url: str, workloads: list[tuple[list[list[int]], list[int]]], concurrency: int,
                 model: str) -> list[dict]:
    import aiohttp

    from entrypoints.bench.serve import CLIENT_KEEPALIVE_S  # idle connections dropped before a server's keep-alive

    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        return [await _pass(session, url, prompts, lens, concurrency, model) for prompts, lens in workloads]


def _client_main(url: str, workloads: list, concurrency: int, model: str, queue) -> None:
    queue.put(asyncio.run(_drive(url, workloads, concurrency, model)))


def run_clients(url: str, workloads: list[tuple[list[list[int]], list[int]]], concurrency: int,
                model: str) -> list[dict]:
    """Run each (prompts, output lengths) pass in turn from one client process; -> one result per pass."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_client_main, args=(url, workloads, concurrency, model, queue))
    process.start()
    while True:  # a client process that dies (e.g. an HTTP error) must fail the benchmark, not hang it
        try:
            result = queue.get(timeout=1.0)
            break
        except queue_module.Empty:
            if not process.is_alive():
                raise RuntimeError(f"the client process exited with code {process.exitcode} before reporting")
    process.join()
    return result
