"""ASGI middleware: request bodies over a byte limit answer 413 before the app parses them."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from server.errors import error_body_for, route_path

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# An over-limit body up to this size is read and dropped before the 413, so the client, still sending, gets
# the answer rather than a reset connection; a larger one is answered at once and the connection closed.
DRAIN_LIMIT_BYTES = 64 << 20


class BodySizeLimit:
    """Refuse bodies longer than `max_bytes`: at once from Content-Length, or as soon as a chunked body
    passes the limit. Accepted bodies are buffered and replayed to the app unchanged."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the request body limit must be >= 1 byte, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= DRAIN_LIMIT_BYTES:
                await _drain(receive)
            await self._refuse(scope, send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    size += await _drain(receive, DRAIN_LIMIT_BYTES - size)
                await self._refuse(scope, send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, send: Send, size: int) -> None:
        body = json.dumps(error_body_for(route_path(scope), 413, f"the request body has {size} bytes or more; this "
                                         f"server accepts at most {self.max_bytes} (--max-request-body-bytes)",
                                         "body")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, budget: int = DRAIN_LIMIT_BYTES) -> int:
    """Read and drop the rest of a body, up to `budget` bytes; -> bytes read."""
    read = 0
    while read <= budget:
        message = await receive()
        if message["type"] != "http.request":
            break
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return read


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body first, then the real channel (disconnect notices keep flowing)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
