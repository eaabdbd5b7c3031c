"""Server-sent events: formatting, merging several request streams, errors mid-stream, disconnects."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from jvllm.engine.request_stream import RequestStream
from jvllm.outputs import RequestOutput
from server.api_errors import APIError, ClientGone
from server.errors import error_body, to_api_error

logger = logging.getLogger("jvllm.server")
T = TypeVar("T")
DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def include_usage(stream_options: Any, force: bool) -> bool:
    """Whether a stream ends with a usage chunk: the request's stream_options.include_usage, or
    --enable-force-include-usage for every stream."""
    return force or bool(stream_options and stream_options.include_usage)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json(exclude_unset=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def error_events(error: APIError) -> list[str]:
    """An error after the headers went out, as the completions and chat streams tell it: its body, then `[DONE]`."""
    return [sse(error_body(error.status, error.message, error.param, error.code)), DONE]


async def with_keep_alive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`events`, with a KEEP_ALIVE comment whenever none came for `interval_s` seconds (0: as they are): a request
    waiting in the queue or in a long prefill sends nothing for a while, and a proxy with a read timeout (nginx's
    60 s) would close the stream."""
    if interval_s <= 0:
        async for event in events:
            yield event
        return
    source = events.__aiter__()
    pending = asyncio.ensure_future(source.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(source.__anext__())
    finally:
        if not pending.done():  # the client left or the body was closed: stop the source where it waits
            pending.cancel()
            await asyncio.wait({pending})


def sse_response(events: AsyncIterator[str], streams: list[RequestStream],
                 on_error: Callable[[APIError], list[str]] = error_events,
                 keep_alive_s: float = 0.0) -> StreamingResponse:
    """Stream `events` (with keep-alive comments after `keep_alive_s` seconds of silence; 0: none); an exception
    becomes the events `on_error` makes of it; the end (or a client that disconnects, which cancels this body)
    closes every request stream, aborting unfinished ones."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in with_keep_alive(events, keep_alive_s):
                yield event
        except Exception as error:  # headers are gone: tell the client in-band
            for event in on_error(to_api_error(error)):
                yield event
        finally:
            for stream in streams:
                stream.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


def check_not_failed(output: RequestOutput) -> RequestOutput:
    """A completion that finished with "error" (its grammar met a parser limit) fails the whole request: a 400, or
    an error event once streaming has begun."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            raise APIError(400, completion.error or "the request could not be completed", code="generation_failed")
    return output


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the stream, output) in arrival order over several requests (one per prompt); a failed output
    raises (check_not_failed)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, check_not_failed(output)
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as error:
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, check_not_failed(item)
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its requests) and raise ClientGone if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():  # the client left: let the cancellation run its cleanup (it aborts the requests)
        await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()
