"""The server raises its open-file limit at start: with a soft limit of a few hundred descriptors, a server that did
not would leave the connections past it unanswered."""
from __future__ import annotations

import resource
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from server.open_files import TARGET_OPEN_FILES, WARN_BELOW_OPEN_FILES

LOW_SOFT_LIMIT = 256
CONNECTIONS = 400
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"

# A minimal uvicorn server of an app that answers "ok", started with the soft limit at LOW_SOFT_LIMIT; with argv[1]
# "raise" it raises the limit first, as `jvllm serve` does. It prints its port, then serves until killed.
SERVER = textwrap.dedent("""
    import socket, sys
    import uvicorn
    from server.open_files import raise_open_files_limit

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    if sys.argv[1] == "raise":
        raise_open_files_limit()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="critical", backlog=2 * %d)).run(sockets=[sock])
""" % CONNECTIONS)


def _limited(soft: int, hard: int | None = None):
    """A preexec_fn that sets the child's open-file limits."""
    def apply() -> None:
        current_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, current_hard if hard is None else hard))
    return apply


def _listening(port: int) -> int:
    """Wait until the server accepts connections on `port`; -> the port."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _hard_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(_hard_limit() < 2 * CONNECTIONS, reason="the hard open-file limit here is too low to show it")
@pytest.mark.parametrize("mode, all_answered", [("raise", True), ("keep", False)])
def test_a_server_that_raised_its_limit_answers_every_concurrent_connection(mode, all_answered):
    server = subprocess.Popen([sys.executable, "-c", SERVER, mode], stdout=subprocess.PIPE, text=True,
                              preexec_fn=_limited(LOW_SOFT_LIMIT))
    connections: list[socket.socket] = []
    try:
        port = _listening(int(server.stdout.readline()))
        for _ in range(CONNECTIONS):  # all open at once: each holds one of the server's descriptors
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
            connection.sendall(REQUEST)
            connections.append(connection)
        deadline = time.monotonic() + 5
        answered = 0
        for connection in connections:
            connection.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                answered += connection.recv(4096).startswith(b"HTTP/1.1 200")
            except OSError:
                pass
        assert (answered == CONNECTIONS) is all_answered, f"{answered} of {CONNECTIONS} answered"
    finally:
        for connection in connections:
            connection.close()
        server.kill()
        server.wait()


def test_the_soft_limit_rises_to_the_target_within_the_hard_limit():
    code = "from server.open_files import raise_open_files_limit; print(raise_open_files_limit())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          preexec_fn=_limited(LOW_SOFT_LIMIT))
    hard = _hard_limit()
    expected = TARGET_OPEN_FILES if hard == resource.RLIM_INFINITY else min(TARGET_OPEN_FILES, hard)
    assert int(done.stdout) == expected


def test_a_low_hard_limit_is_reported_with_how_to_raise_it():
    code = ("import logging; logging.basicConfig(); "
            "from server.open_files import raise_open_files_limit; print(raise_open_files_limit())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          preexec_fn=_limited(LOW_SOFT_LIMIT, hard=512))
    assert int(done.stdout) == 512 < WARN_BELOW_OPEN_FILES
    assert "open-file limit is 512" in done.stderr and "ulimit -Hn" in done.stderr
