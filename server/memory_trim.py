"""ASGI middleware: after a request with a large body, freed heap memory goes back to the OS (glibc's malloc_trim).
glibc keeps what a thread's arena freed for reuse, so each of the tokenizer pool's threads that once parsed or
tokenized a large input would otherwise hold its peak resident."""
from __future__ import annotations

import asyncio

from jvllm.heap import release_freed_memory
from server.body_limit import ASGIApp, Message, Receive, Scope, Send

TRIM_AFTER_BYTES = 512 << 10


class TrimAfterLargeBodies:
    """Counts each request's body bytes as the app reads them; once a request of TRIM_AFTER_BYTES or more has been
    answered, trims the heap on a worker thread (one trim at a time; a trim already running covers the next)."""

    def __init__(self, app: ASGIApp, threshold: int = TRIM_AFTER_BYTES) -> None:
        self.app = app
        self.threshold = threshold
        self._trimming: asyncio.Future | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if size >= self.threshold and (self._trimming is None or self._trimming.done()):
                self._trimming = asyncio.get_running_loop().run_in_executor(None, release_freed_memory)


