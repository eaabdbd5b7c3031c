"""Idle HTTP connections: the server keeps them open longer than common clients keep theirs for reuse, so a client
never sends a request on a connection the server is closing at that moment (which fails with "Server
disconnected"); `--timeout-keep-alive` sets how long, and reaches uvicorn."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from server.serve import uvicorn_config
from server.settings import ServerSettings
from tests.server.minimal_app import ok_app, serving

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


def _answered(connection: socket.socket) -> bool:
    """Send one request on the connection; whether a whole 200 response came back (False: the server closed it)."""
    try:
        connection.sendall(REQUEST)
        reply = b""
        while not reply.endswith(b"ok"):
            chunk = connection.recv(4096)
            if not chunk:
                return False
            reply += chunk
        return reply.startswith(b"HTTP/1.1 200")
    except OSError:
        return False


@pytest.mark.parametrize("keep_alive_s, idle_s, reused", [(2.0, 1.0, True), (0.3, 1.0, False)])
def test_an_idle_connection_stays_open_for_the_keep_alive_time(keep_alive_s, idle_s, reused):
    with serving(timeout_keep_alive=keep_alive_s) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
            assert _answered(connection)
            time.sleep(idle_s)
            assert _answered(connection) is reused


async def _aiohttp_keep_alive() -> float:
    import aiohttp

    connector = aiohttp.TCPConnector()
    try:
        return connector._keepalive_timeout
    finally:
        await connector.close()


def test_the_default_outlasts_the_clients_own_keep_alive():
    import httpx
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    default = ServerSettings(["m"]).timeout_keep_alive
    assert uvicorn_config(ok_app, ServerSettings(["m"])).timeout_keep_alive == default
    assert default > httpx.Limits(max_connections=None).keepalive_expiry  # httpx's own default
    assert default > DEFAULT_CONNECTION_LIMITS.keepalive_expiry  # the openai client's
    assert default > asyncio.run(_aiohttp_keep_alive())  # aiohttp's default (15 s)


def test_a_keep_alive_time_must_be_positive():
    with pytest.raises(ValueError, match="timeout-keep-alive"):
        ServerSettings(["m"], timeout_keep_alive=0)
