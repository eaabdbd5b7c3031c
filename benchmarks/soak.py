"""Soak test: N minutes of mixed, partly hostile traffic against a real `jvllm serve`, then a health audit.

Starts `jvllm serve` in a subprocess with a small KV pool (so long requests preempt each other) and a small
body limit, then runs concurrent clients for --minutes: completions and chats (streamed or not, n 1-3,
logprobs, stops, JSON / regex / required-tool constraints), clients that leave mid-stream or before a whole response, bad inputs that must be
refused (lone surrogates, n past the limit, prompts past the context, oversized bodies, malformed JSON,
request chat templates, wrong types), tokenizer routes, and a /health probe every 50 ms. Afterwards it
asserts: no 5xx; every bad input a 4xx within 1 s; running, waiting and KV usage back to 0; the server's
resident memory in the last quarter no higher than allowed over the first; a clean SIGTERM exit (0) and
no traceback in the log. Not part of CI: `python -m benchmarks.soak --minutes 10 --json out.json`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx

from benchmarks.common import command_line, write_json

BAD_INPUT_DEADLINE_S = 1.0
MAX_PROMPT_CHARS = 100_000
MEMORY_GROWTH_LIMIT = 0.10  # resident memory of the last quarter of the run over the first quarter's peak


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"]}}}
WORDS = ("the river ran past the old mill and the children followed it down to the sea where boats were "
         "waiting for the tide to turn").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def bad_inputs(max_prompt_chars: int, body_limit: int) -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of requests that must be refused with a 4xx."""
    cases = [
        ("surrogate prompt", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("surrogate chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
        ("surrogate tokenize", "/tokenize", b'{"prompt": "\\ud800"}'),
        ("huge n", "/v1/completions", b'{"prompt": "hi", "n": 1000000000, "max_tokens": 2}'),
        ("huge best_of", "/v1/completions", b'{"prompt": "hi", "n": 1, "best_of": 100000}'),
        ("too many prompts", "/v1/completions", json.dumps({"prompt": ["x"] * 5000, "max_tokens": 1}).encode()),
        ("prompt past the context", "/v1/completions",
         json.dumps({"prompt": "a" * (max_prompt_chars + 1)}).encode()),
        ("body past the limit", "/v1/completions", b'{"prompt": "' + b"a" * body_limit + b'"}'),
        ("malformed json", "/v1/completions", b'{"prompt": "hi",'),
        ("wrong type", "/v1/completions", b'{"prompt": "hi", "max_tokens": "many"}'),
        ("max_tokens 0", "/v1/completions", b'{"prompt": "hi", "max_tokens": 0}'),
        ("seed 2^64", "/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}'),
        ("logprobs 50", "/v1/completions", b'{"prompt": "hi", "logprobs": 50}'),
        ("request chat template", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ \'a\' * 50000000 }}"}'),
        ("unknown model", "/v1/completions", b'{"prompt": "hi", "model": "nope"}'),
        ("bad token id", "/detokenize", b'{"tokens": [-5]}'),
        ("schema that does not compile", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "not": {}}}}}).encode()),
        ("regex that does not compile", "/v1/completions",
         b'{"prompt": "hi", "structured_outputs": {"regex": "a(b"}}'),
        ("unknown tool", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}).encode()),
    ]
    return cases


class Soak:
    def __init__(self, url: str, seconds: float, concurrency: int, seed: int, max_prompt_chars: int,
                 body_limit: int) -> None:
        self.url, self.seconds, self.concurrency = url, seconds, concurrency
        self.rng = random.Random(seed)
        self.statuses: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.bad_slow: list[str] = []
        self.bad_not_refused: list[str] = []
        self.bad_latency: list[float] = []
        self.health_latency: list[float] = []
        self.health_failures = 0
        self.bad = bad_inputs(max_prompt_chars, body_limit)

    def _record(self, kind: str, status: int) -> None:
        self.statuses[f"{kind} {status}"] += 1
        if status >= 500:
            self.server_errors.append(f"{kind}: {status}")

    async def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        limits = httpx.Limits(max_connections=self.concurrency + 8)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            workers = [self._worker(client, deadline) for _ in range(self.concurrency)]
            await asyncio.gather(self._health(client, deadline), *workers)

    async def _health(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                reply = await client.get("/health", timeout=10)
                ok = reply.status_code == 200
            except httpx.HTTPError:
                ok = False
            self.health_latency.append(time.perf_counter() - started)
            self.health_failures += not ok
            await asyncio.sleep(0.05)

    async def _worker(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = self.rng.choices(["generate", "stream", "leave_stream", "leave_whole", "bad", "tokens"],
                                    weights=[30, 30, 10, 5, 20, 5])[0]
            try:
                await getattr(self, f"_{kind}")(client)
            except httpx.HTTPError as error:  # the server must not drop connections on its own
                self.server_errors.append(f"{kind}: {type(error).__name__} {error}")

    def _sampling(self) -> dict:
        body = {"max_tokens": self.rng.randint(1, 160), "n": self.rng.choice([1, 1, 1, 2, 3]),
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "seed": self.rng.randint(0, 2**31)}
        if self.rng.random() < 0.3:
            body["stop"] = [self.rng.choice(WORDS)]
        if self.rng.random() < 0.2:
            body["ignore_eos"] = True
        return body

    def _request(self) -> tuple[str, dict]:
        prompt = _text(self.rng, self.rng.randint(1, 200))
        if self.rng.random() < 0.5:
            body = {"prompt": prompt, **self._sampling()}
            if self.rng.random() < 0.3:
                body["logprobs"] = self.rng.randint(0, 5)
            return "/v1/completions", body
        body = {"messages": [{"role": "user", "content": prompt}], **self._sampling()}
        if self.rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=self.rng.randint(0, 5))
        constraint = self.rng.choice([None, None, None, "json", "regex", "tools"])
        if constraint == "json":
            body["response_format"] = {"type": "json_object"}
        elif constraint == "regex":
            body["structured_outputs"] = {"regex": "[a-z ]{1,80}"}
        elif constraint == "tools":
            body.update(tools=[TOOL], tool_choice="required")
        return "/v1/chat/completions", body

    async def _generate(self, client: httpx.AsyncClient) -> None:
        path, body = self._request()
        reply = await client.post(path, json=body)
        self._record("generate", reply.status_code)

    async def _stream(self, client: httpx.AsyncClient, leave_after: int | None = None) -> None:
        path, body = self._request()
        async with client.stream("POST", path, json={**body, "stream": True}) as reply:
            self._record("stream", reply.status_code)
            events = 0
            async for line in reply.aiter_lines():
                if line.startswith("data: {\"error\""):
                    self.server_errors.append(f"stream error event: {line[:200]}")
                events += line.startswith("data: ")
                if leave_after is not None and events >= leave_after:
                    return  # leaving the block closes the connection mid-stream

    async def _leave_stream(self, client: httpx.AsyncClient) -> None:
        await self._stream(client, leave_after=self.rng.randint(1, 5))

    async def _leave_whole(self, client: httpx.AsyncClient) -> None:
        path, body = self._request()
        try:
            reply = await client.post(path, json={**body, "max_tokens": 160, "ignore_eos": True},
                                      timeout=self.rng.uniform(0.05, 1.0))
            self._record("leave_whole", reply.status_code)
        except httpx.TimeoutException:
            self.statuses["leave_whole left"] += 1

    async def _bad(self, client: httpx.AsyncClient) -> None:
        name, path, raw = self.rng.choice(self.bad)
        started = time.perf_counter()
        reply = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
        seconds = time.perf_counter() - started
        self.bad_latency.append(seconds)
        self._record("bad", reply.status_code)
        if not 400 <= reply.status_code < 500:
            self.bad_not_refused.append(f"{name}: {reply.status_code}")
        if seconds > BAD_INPUT_DEADLINE_S:
            self.bad_slow.append(f"{name}: {seconds:.2f}s")

    async def _tokens(self, client: httpx.AsyncClient) -> None:
        reply = await client.post("/tokenize", json={"prompt": _text(self.rng, self.rng.randint(1, 2000))})
        self._record("tokenize", reply.status_code)
        if reply.status_code == 200:
            detok = await client.post("/detokenize", json={"tokens": reply.json()["tokens"]})
            self._record("detokenize", detok.status_code)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded SmolLM2)")
    parser.add_argument("--concurrency", type=int, default=16, help="client workers at once")
    parser.add_argument("--kv-cache-memory-bytes", default="96M",
                        help="small (SmolLM2: ~2,100 tokens), so that requests preempt each other")
    parser.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    command = [sys.executable, "-m", "entrypoints.cli", "serve", *([args.model] if args.model else []), "--port",
               str(port), "--max-num-seqs", "32", "--max-model-len", "2048", "--kv-cache-memory-bytes",
               args.kv_cache_memory_bytes, "--max-request-body-bytes", str(args.max_request_body_bytes),
               "--max-waiting-requests", "64", "--max-prompt-chars", str(MAX_PROMPT_CHARS), "--shutdown-timeout", "20",
               "--disable-access-log"]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        soak = Soak(url, args.minutes * 60, args.concurrency, args.seed, MAX_PROMPT_CHARS, args.max_request_body_bytes)
        memory: list[tuple[float, float]] = []
        started = time.monotonic()

        async def sample_memory() -> None:
            while time.monotonic() - started < soak.seconds:
                memory.append((time.monotonic() - started, _rss_mib(proc.pid)))
                await asyncio.sleep(5)

        async def both() -> None:
            await asyncio.gather(soak.run(), sample_memory())

        asyncio.run(both())
        idle = _wait_idle(url)
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    log_text = log.read()
    quarter = max(1, len(memory) // 4)
    first_peak = max(rss for _, rss in memory[:quarter])
    last_peak = max(rss for _, rss in memory[-quarter:])
    results = {
        "command": command_line("benchmarks.soak", argv), "minutes": args.minutes, "server": " ".join(command[2:]),
        "requests": sum(soak.statuses.values()), "statuses": dict(sorted(soak.statuses.items())),
        "server_errors": soak.server_errors[:50], "bad_inputs_not_refused": soak.bad_not_refused,
        "bad_inputs_slower_than_1s": soak.bad_slow, "bad_input_latency_max_s": max(soak.bad_latency, default=0),
        "health_probes": len(soak.health_latency), "health_failures": soak.health_failures,
        "health_p50_ms": statistics.median(soak.health_latency) * 1e3,
        "health_p99_ms": _percentile(soak.health_latency, 0.99) * 1e3,
        "idle_after": idle, "rss_mib": memory, "rss_first_quarter_peak_mib": first_peak,
        "rss_last_quarter_peak_mib": last_peak, "exit_code": exit_code,
        "log_tracebacks": log_text.count("Traceback"), "log_asgi_exceptions": log_text.count("Exception in ASGI"),
        "log": log.name,
    }
    failures = []
    if soak.server_errors:
        failures.append(f"{len(soak.server_errors)} server errors, e.g. {soak.server_errors[:3]}")
    if soak.bad_not_refused or soak.bad_slow:
        failures.append(f"bad inputs not refused {soak.bad_not_refused[:3]} or slow {soak.bad_slow[:3]}")
    if not idle["idle"]:
        failures.append(f"not idle afterwards: {idle}")
    if idle["num_preemptions"] == 0:
        failures.append("no preemption happened: the KV pool was not small enough to test it")
    if last_peak > first_peak * (1 + MEMORY_GROWTH_LIMIT):
        failures.append(f"memory grew from {first_peak:.0f} to {last_peak:.0f} MiB")
    if exit_code != 0 or results["log_tracebacks"] or results["log_asgi_exceptions"]:
        failures.append(f"exit {exit_code}, {results['log_tracebacks']} tracebacks in {log.name}")
    results["failures"] = failures
    write_json(args.json, results)
    print(json.dumps({k: v for k, v in results.items() if k != "rss_mib"}, indent=2))
    return 1 if failures else 0


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def _wait_idle(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        state = {"running": _metric(text, "jvllm:num_requests_running"),
                 "waiting": _metric(text, "jvllm:num_requests_waiting"),
                 "kv_cache_usage": _metric(text, "jvllm:kv_cache_usage_perc"),
                 "num_preemptions": _metric(text, "jvllm:num_preemptions_total")}
        state["idle"] = state["running"] == state["waiting"] == state["kv_cache_usage"] == 0
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
