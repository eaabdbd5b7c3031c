"""Counts XLA executables this process prepares (compiled, or loaded from the persistent cache) through
jax.monitoring, and warns about any that an engine did not expect: after start-up, every step shape should
already be compiled, so a compile there is a bug worth naming."""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Iterator

import jax

logger = logging.getLogger("jvllm")

# Emitted once per lowering to MLIR: every compile and every persistent-cache load starts with one.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class CompileWatch:
    """Process-wide: `expected()` marks compiles the engine asks for (precompiling, diagnostics); any other is
    counted in `unexpected` and logged with the step shape the thread was running (`running(shape)`)."""

    def __init__(self) -> None:
        self.total = 0
        self.unexpected = 0
        self._local = threading.local()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_s: float, **_: object) -> None:
        if event != _LOWERING_EVENT:
            return
        self.total += 1
        if getattr(self._local, "expected", 0):
            return
        self.unexpected += 1
        shape = getattr(self._local, "shape", None)
        logger.warning("XLA compiled an executable after start-up%s: every step shape should be compiled at "
                       "start (this is a bug; please report it)", f" while running {shape}" if shape else "")

    @contextlib.contextmanager
    def expected(self) -> Iterator[None]:
        self._local.expected = getattr(self._local, "expected", 0) + 1
        try:
            yield
        finally:
            self._local.expected -= 1

    @contextlib.contextmanager
    def running(self, shape: object) -> Iterator[None]:
        previous, self._local.shape = getattr(self._local, "shape", None), shape
        try:
            yield
        finally:
            self._local.shape = previous


def during_start_up(init: Callable[..., None]) -> Callable[..., None]:
    """Decorates a constructor whose compiles (loading weights, precompiling) are all expected."""
    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        with compile_watch().expected():
            init(*args, **kwargs)
    return wrapped


_WATCH: CompileWatch | None = None
_LOCK = threading.Lock()


def compile_watch() -> CompileWatch:
    """The process's watch (registered with jax.monitoring on first use)."""
    global _WATCH
    with _LOCK:
        if _WATCH is None:
            _WATCH = CompileWatch()
        return _WATCH
