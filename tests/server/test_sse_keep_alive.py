"""`--sse-keep-alive-interval` (vLLM's flag): a stream that has sent nothing for that long gets an SSE comment, which
clients skip, so a proxy's read timeout does not close a request still waiting in the queue."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server.settings import ServerSettings
from server.streaming import KEEP_ALIVE, with_keep_alive
from tests.server.conftest import API_KEY, MODEL, start_server


async def _gapped(log: list[str], fail: bool = False):
    """'a', a 0.25 s silence, then 'b' (or an error); `log` records a clean-up."""
    try:
        yield "a"
        await asyncio.sleep(0.25)
        if fail:
            raise RuntimeError("the engine failed")
        yield "b"
    finally:
        log.append("closed")


async def _collect(interval_s: float, fail: bool = False) -> tuple[list[str], list[str]]:
    log: list[str] = []
    return [event async for event in with_keep_alive(_gapped(log, fail), interval_s)], log


def test_silences_get_keep_alive_comments_between_the_events():
    events, log = asyncio.run(_collect(0.05))
    assert events[0] == "a" and events[-1] == "b" and log == ["closed"]
    assert 2 <= events.count(KEEP_ALIVE) == len(events) - 2
    assert asyncio.run(_collect(0.0))[0] == ["a", "b"]  # 0: off


def test_an_error_of_the_source_reaches_the_stream():
    with pytest.raises(RuntimeError, match="the engine failed"):
        asyncio.run(_collect(0.05, fail=True))


def test_a_consumer_that_stops_stops_the_source_where_it_waits():
    async def stop_during_the_silence() -> list[str]:
        log: list[str] = []
        stream = with_keep_alive(_gapped(log), 0.05)
        assert await stream.__anext__() == "a"
        assert await stream.__anext__() == KEEP_ALIVE
        await stream.aclose()  # as the server does when the client disconnects
        return log

    assert asyncio.run(stop_during_the_silence()) == ["closed"]


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="sse-keep-alive-interval"):
        ServerSettings(["m"], sse_keep_alive_interval=-1)


@pytest.fixture(scope="module")
def chatty_server(tiny_llama):
    server = start_server(tiny_llama, settings={"sse_keep_alive_interval": 0.001})  # every gap gets comments
    yield server
    server.stop()


def test_streams_with_comments_give_clients_the_same_text(chatty_server):
    from openai import OpenAI

    messages = [{"role": "user", "content": "Tell me a story."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{chatty_server.v1}/chat/completions", json=body, headers=chatty_server.headers) as raw:
        lines = raw.read().decode().split("\n\n")
    assert KEEP_ALIVE.strip() in lines and lines[-2] == "data: [DONE]"
    with OpenAI(base_url=chatty_server.v1, api_key=API_KEY, max_retries=0) as client:
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True) if chunk.choices)
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert streamed == whole.choices[0].message.content
