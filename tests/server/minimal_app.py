"""A minimal ASGI app under uvicorn, configured as `jvllm serve` configures it (`server.serve.uvicorn_config`), for
tests of what the server's settings do to connections (keep-alive, TLS, Unix sockets) without an engine."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import uvicorn

from server.serve import uvicorn_config
from server.settings import ServerSettings


async def ok_app(scope, receive, send) -> None:
    """200 "ok" to every HTTP request."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def serving(**settings) -> Iterator[int | None]:
    """`ok_app` served with ServerSettings(**settings) on a free loopback port (or on `uds=`); -> the port (None on a
    Unix socket). Stopped on exit."""
    settings = {"log_level": "error", **settings}
    sock = None
    if settings.get("uds") is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(ok_app, ServerSettings(["m"], **settings)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]} if sock else {}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield None if sock is None else sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
