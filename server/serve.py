"""`jvllm serve`: load the engine, start uvicorn, drain in-flight requests on SIGTERM, exit 0."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

import uvicorn

from jvllm.collector import freeze_start_up_heap
from jvllm.engine.async_engine import AsyncEngine
from server.open_files import raise_open_files_limit

if TYPE_CHECKING:
    from jvllm.engine.arg_utils import EngineArgs
    from server.settings import ServerSettings

# The engine thread holds the GIL for its host-side work; a waiting event-loop thread would get it only
# after the default 5 ms switch interval. A shorter interval keeps streaming latency low.
GIL_SWITCH_INTERVAL_S = 0.001
# uvicorn's own deadline comes this long after the drain deadline: by then every request has been ended by
# the drain, so uvicorn never has to cancel a running response (which logs a traceback per request).
UVICORN_BACKSTOP_S = 10.0

logger = logging.getLogger("jvllm.server")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the template text itself."""
    if value is None:
        return None
    path = pathlib.Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # e.g. a template too long to be a file name
        pass
    return value


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain deadline of its own. After SIGTERM (or `should_exit`) it stops accepting
    connections and lets open requests finish for `drain_timeout` seconds; then it shuts the engine down, so
    each open stream ends with an error event and `[DONE]` and each waiting response answers 503."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        config.timeout_graceful_shutdown = drain_timeout + UVICORN_BACKSTOP_S
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self._end_open_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_open_requests(self) -> None:
        logger.warning("shutdown timeout (%gs) reached: ending the requests still open", self.drain_timeout)
        asyncio.ensure_future(self.engine.shutdown())


def uvicorn_config(app: Any, settings: ServerSettings) -> uvicorn.Config:
    """uvicorn's configuration of the server: address, TLS, logging and how long idle connections stay open."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          access_log=not settings.disable_access_log, server_header=False,
                          timeout_keep_alive=settings.timeout_keep_alive, root_path=settings.root_path or "",
                          ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile,
                          ssl_ca_certs=settings.ssl_ca_certs, ssl_cert_reqs=settings.ssl_cert_reqs, uds=settings.uds)


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """Load the engine and serve it until SIGTERM or Ctrl-C; `settings.served_model_names` empty: the model's
    own name."""
    from jvllm.config import UsageContext
    from jvllm.engine.llm import Engine
    from server.app import build_app

    raise_open_files_limit()
    engine = Engine.from_engine_args(engine_args, UsageContext.OPENAI_API_SERVER)
    if not engine.is_leader:  # multi-host: rank 0 serves HTTP and schedules; this host runs its steps
        logger.info("this host follows rank 0's steps")
        engine.follow()
        return 0
    async_engine = AsyncEngine(engine, max_waiting_requests=settings.max_waiting_requests)
    settings.served_model_names = settings.served_model_names or [engine.served_model_name]
    settings.model_root = settings.model_root or engine.served_model_name
    settings.chat_template = load_chat_template(settings.chat_template)
    app = build_app(async_engine, settings)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    freeze_start_up_heap()  # no ~0.4 s full collections stalling the streams (jvllm.collector)
    server = DrainingServer(uvicorn_config(app, settings), async_engine, settings.shutdown_timeout)
    # uvicorn catches SIGTERM/SIGINT, stops accepting, and shuts down (see DrainingServer), stops the engine,
    # and finally re-raises the signal. With no-op handlers underneath, that re-raise ends in a clean exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    keys = len(settings.api_keys)
    auth = "off" if not keys else "on" if keys == 1 else f"on, {keys} keys"
    logger.info("serving %s on %s (API key %s, pid %d)", settings.model_name, settings.address, auth, os.getpid())
    server.run()  # returns after the lifespan shutdown stopped the engine thread
    engine.shutdown()  # multi-host: release the followers
    return 0
