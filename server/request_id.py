"""`--enable-request-id-headers`: every response carries an X-Request-Id header, the request's own if it sent a usable
one (up to 128 visible ASCII characters), else a new one, so logs on both sides can be matched."""
from __future__ import annotations

import uuid
from typing import Any, Awaitable, Callable

HEADER = b"x-request-id"
MAX_ID_BYTES = 128


def _usable(value: bytes) -> bool:
    return 0 < len(value) <= MAX_ID_BYTES and all(0x21 <= byte <= 0x7E for byte in value)


class RequestIdHeader:
    """A pure ASGI middleware (streamed bodies pass through untouched) that adds the header to each HTTP response."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope.get("headers", ()) if name.lower() == HEADER), b"")
        request_id = given if _usable(given) else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", ()) if name.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
