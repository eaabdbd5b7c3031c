"""Start-up progress for `LLM()` in a plain Python program: the engine's INFO lines (each loading phase with its time,
the KV pool, the compile) go to stderr, as vLLM's do, unless the program configured logging itself."""
from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_default_logging() -> None:
    """Give the `jvllm` logger a stderr handler at INFO when nobody set up logging: no handler on it or on the root
    logger (the CLI, servers, pytest and most applications have one), and JVLLM_CONFIGURE_LOGGING is not 0.
    JVLLM_LOGGING_LEVEL (e.g. WARNING) or logging.getLogger("jvllm").setLevel(...) quiets it."""
    logger = logging.getLogger("jvllm")
    if os.environ.get("JVLLM_CONFIGURE_LOGGING", "1") == "0" or logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(os.environ.get("JVLLM_LOGGING_LEVEL", "INFO").upper())
