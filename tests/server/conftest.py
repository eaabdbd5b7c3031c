"""Live uvicorn servers on loopback ports, each over a tiny random Llama engine, started once per session."""
from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Any

import pytest

API_KEY = "sk-test-key"
MODEL = "tiny-llama"
# float32: served outputs are compared with an offline twin's, which ran in another batch (the bf16 batched copy's
# rounding depends on the batch); precompile=False: each shape compiles when a test first meets it
# (tests/jvllm/test_no_compile.py covers precompiling, tests/server/test_cli_serve.py the CLI's defaults)
ENGINE_ARGS = dict(dtype="float32", max_num_seqs=64, kv_cache_memory_bytes=64 << 20, max_model_len=512,
                   precompile=False)


@dataclasses.dataclass
class LiveServer:
    url: str
    engine: Any  # the AsyncEngine behind the app
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def start_server(model_dir, *, max_waiting_requests: int | None = 1000, served_model_names: list[str] | None = None,
                 engine_args: dict | None = None, settings: dict | None = None, drain_timeout: float = 10.0,
                 **engine_overrides) -> LiveServer:
    from jvllm import Engine
    from jvllm.engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.serve import DrainingServer, uvicorn_config
    from server.settings import ServerSettings

    args = {**(ENGINE_ARGS if engine_args is None else engine_args), **engine_overrides}
    model = None if model_dir is None else str(model_dir)  # None: the default model
    engine = AsyncEngine(Engine(model=model, **args), max_waiting_requests=max_waiting_requests)
    server_settings = ServerSettings(served_model_names or [MODEL, "alias"], model_root=model,
                                     **{"api_key": API_KEY, "log_level": "warning", **(settings or {})})
    app = build_app(engine, server_settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn_config(app, server_settings), engine, drain_timeout)  # as `jvllm serve`
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"{server_settings.scheme}://127.0.0.1:{port}", engine, app, server, thread)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def live_server(tiny_llama):
    """The main server: 64 sequences, a generous waiting queue, API key required on /v1."""
    server = start_server(tiny_llama)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def offline_engine(tiny_llama):
    """A second engine on the same weights for offline twins of served requests."""
    from jvllm import Engine

    return Engine(model=str(tiny_llama), **ENGINE_ARGS)


@pytest.fixture
def client(live_server):
    import openai

    return openai.OpenAI(base_url=live_server.v1, api_key=API_KEY, max_retries=0, timeout=600)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def idle(engine) -> bool:
    """No request left anywhere and every KV page back on the free list."""
    stats = engine.stats
    pages = engine.engine.pages
    return (stats.num_running == 0 and stats.num_waiting == 0 and not engine._streams
            and pages.num_free_pages == pages.num_usable_pages)


class LogRecords(logging.Handler):
    """Keeps the records of `level` and above that the server's loggers emit while attached."""

    LOGGERS = ("uvicorn.error", "jvllm.server", "jvllm.engine.async_engine")

    def __init__(self, level: int = logging.ERROR) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> list[logging.LogRecord]:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self.records

    def __exit__(self, *exc: Any) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


@pytest.fixture
def server_errors():
    """ERROR records (tracebacks among them) of the server's loggers during the test."""
    with LogRecords() as records:
        yield records
