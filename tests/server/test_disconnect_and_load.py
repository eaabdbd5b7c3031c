"""Disconnects abort requests and free their pages; 64 concurrent streams each equal their offline twin."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx

from tests.server.conftest import API_KEY, idle, wait_until

LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith(name)).rsplit(" ", 1)[1])


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_pages(live_server):
    """The client leaves at the first chunk. On a loaded machine the tiny model may write all 480 tokens before the
    client gets to leave; such an attempt must have finished by length, and the next one is tried."""
    engine = live_server.engine
    for _ in range(3):
        aborted = _metric(live_server, 'jvllm:request_success_total{finished_reason="abort"')
        finished = _metric(live_server, 'jvllm:request_success_total{finished_reason="length"')
        with httpx.stream("POST", f"{live_server.v1}/completions", headers=live_server.headers, timeout=600,
                          json={"prompt": "Leave early", "stream": True, **LONG}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    break
        assert wait_until(lambda: idle(engine)), engine.stats
        engine.engine.pages.check_integrity()
        if _metric(live_server, 'jvllm:request_success_total{finished_reason="abort"') == aborted + 1:
            assert _metric(live_server, 'jvllm:request_success_total{finished_reason="length"') == finished
            break
        assert _metric(live_server, 'jvllm:request_success_total{finished_reason="length"') == finished + 1
    else:
        raise AssertionError("every attempt finished before its client left")
    assert wait_until(lambda: _metric(live_server, "jvllm:kv_cache_usage_perc") == 0.0)


def test_a_client_leaving_a_non_streamed_request_aborts_it(live_server):
    engine = live_server.engine
    aborted = _metric(live_server, 'jvllm:request_success_total{finished_reason="abort"')
    body = json.dumps({"messages": [{"role": "user", "content": "Take your time"}], "max_tokens": 450,
                       "ignore_eos": True}).encode()
    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: engine.stats.num_running == 1, interval=0.001)
    assert wait_until(lambda: idle(engine)), engine.stats
    assert _metric(live_server, 'jvllm:request_success_total{finished_reason="abort"') == aborted + 1


def _twin_params(i: int):
    from jvllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=6 + i % 11)


async def _stream(client: httpx.AsyncClient, server, i: int) -> tuple[str, str | None, int]:
    """One streaming client: even ones use completions, odd ones chat; -> (text, finish_reason, tokens)."""
    body = {"stream": True, "temperature": 0, "max_tokens": 6 + i % 11, "stream_options": {"include_usage": True}}
    if i % 2:
        path, body["messages"] = "/chat/completions", [{"role": "user", "content": f"Question {i}: why?"}]
    else:
        path, body["prompt"] = "/completions", f"Story number {i} begins"
    text, finish, tokens = "", None, 0
    async with client.stream("POST", f"{server.v1}{path}", json=body, headers=server.headers) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            for choice in event["choices"]:
                text += (choice["delta"].get("content") or "") if i % 2 else choice["text"]
                finish = choice["finish_reason"] or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return text, finish, tokens


def test_64_concurrent_streams_each_equal_their_offline_twin(live_server, offline_engine):
    prompts = [f"Story number {i} begins" for i in range(0, 64, 2)]
    chats = [[{"role": "user", "content": f"Question {i}: why?"}] for i in range(1, 64, 2)]
    expected = {}
    for i, out in zip(range(0, 64, 2), offline_engine.generate(prompts, [_twin_params(i) for i in range(0, 64, 2)],
                                                              use_tqdm=False)):
        expected[i] = out.outputs[0]
    for i, out in zip(range(1, 64, 2), offline_engine.chat(chats, [_twin_params(i) for i in range(1, 64, 2)],
                                                           use_tqdm=False)):
        expected[i] = out.outputs[0]
    most_running = 0

    async def watch() -> None:
        nonlocal most_running
        while True:
            most_running = max(most_running, live_server.engine.stats.num_running)
            await asyncio.sleep(0.005)

    async def main():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            watcher = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(*(_stream(client, live_server, i) for i in range(64)))
            finally:
                watcher.cancel()

    results = asyncio.run(main())
    for i, (text, finish, tokens) in enumerate(results):
        assert (text, finish, tokens) == (expected[i].text, expected[i].finish_reason, len(expected[i].token_ids)), i
    assert most_running > 8  # they really ran together, not one after another
    assert wait_until(lambda: idle(live_server.engine))
