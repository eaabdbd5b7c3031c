"""RequestStream: one request's cumulative outputs, read with `async for` on the caller's event loop."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from jvllm.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """One request's outputs, read on the caller's event loop: `async for output in stream`.

    Outputs are cumulative snapshots, so an unread one is replaced by a newer one without losing
    anything: a slow reader gets fewer, larger updates. `close()` before the end calls `on_close`, which
    aborts the request."""

    def __init__(self, request_id: str, prompt: Any, loop: asyncio.AbstractEventLoop,
                 on_close: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.last: RequestOutput | None = None
        self.done = False  # a final output or an error was delivered
        self.closed = False  # the reader went away
        self.loop = loop  # the reader's event loop
        self._on_close = on_close
        self._item: RequestOutput | BaseException | None = None
        self._event = asyncio.Event()
        self._returned_final = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.done:
            return
        if isinstance(item, RequestOutput):
            self.last = item
            self.done = item.finished
        else:
            self.done = True
        if not isinstance(self._item, BaseException):  # an error, once queued, is not overwritten
            self._item = item
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._returned_final or self.closed:
            raise StopAsyncIteration
        try:
            await self._event.wait()
        except BaseException:
            self.close()  # cancelled: the reader is gone
            raise
        item, self._item = self._item, None
        self._event.clear()
        if isinstance(item, BaseException):
            self._returned_final = True
            self.close()
            raise item
        assert item is not None
        if item.finished:
            self._returned_final = True
            self.close()
        return item

    def close(self) -> None:
        """Stop reading; a request still running is aborted and its pages freed."""
        if self.closed:
            return
        self.closed = True
        self._on_close(self)

    async def aclose(self) -> None:
        self.close()


def aborted_output(request_id: str, stream: RequestStream) -> RequestOutput:
    """The final snapshot of a request stopped from outside: its last state, marked "abort"."""
    last = stream.last
    if last is None:
        prompt = stream.prompt
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
        return RequestOutput(request_id, text, ids, None, [CompletionOutput(0, "", [], None, None, "abort")], True)
    outputs = [dataclasses.replace(o, finish_reason=o.finish_reason or "abort") for o in last.outputs]
    return dataclasses.replace(last, outputs=outputs, finished=True)
