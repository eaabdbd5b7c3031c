"""`jvllm serve`: load the engine, start uvicorn, drain in-flight requests on SIGTERM, exit 0."""
from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys
from typing import Any

# The engine thread holds the GIL for its host-side work; a waiting event-loop thread would get it only
# after the default 5 ms switch interval. A shorter interval keeps streaming latency low.
GIL_SWITCH_INTERVAL_S = 0.001

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


def run_server(engine_kwargs: dict[str, Any], *, host: str, port: int, api_key: str | None,
               served_model_names: list[str] | None, enable_log_requests: bool, max_waiting_requests: int | None,
               shutdown_timeout: float, chat_template: str | None, max_logprobs: int, log_level: str,
               access_log: bool) -> int:
    import uvicorn

    from jvllm.async_engine import AsyncEngine
    from jvllm.engine import Engine
    from server.app import build_app
    from server.settings import ServerSettings

    engine = Engine(**engine_kwargs)
    if not engine.is_leader:  # multi-host: rank 0 serves HTTP and schedules; this host runs its steps
        logger.info("this host follows rank 0's steps")
        engine.follow()
        return 0
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
    settings = ServerSettings(served_model_names or [engine.served_model_name], api_key=api_key,
                              enable_log_requests=enable_log_requests, max_logprobs=max_logprobs,
                              chat_template=load_chat_template(chat_template),
                              model_root=engine_kwargs.get("model") or engine.served_model_name)
    app = build_app(async_engine, settings)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout, server_header=False)
    server = uvicorn.Server(config)
    # uvicorn catches SIGTERM/SIGINT, stops accepting, lets open responses finish (up to the timeout,
    # then cancels them, which aborts their requests), stops the engine, and finally re-raises the
    # signal. With no-op handlers underneath, that re-raise ends in a clean exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    auth = "on" if api_key else "off"
    logger.info("serving %s on http://%s:%d (API key %s, pid %d)", settings.model_name, host, port, auth,
                   os.getpid())
    server.run()  # returns after the lifespan shutdown stopped the engine thread
    engine.shutdown()  # multi-host: release the followers
    return 0
