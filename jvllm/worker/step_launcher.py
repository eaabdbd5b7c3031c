"""Dispatching steps from a thread of their own, so that the host's other work for a step overlaps the calls.

A GPU executable's call costs the host ~150-190 us (its kernels' launches and the runtime's bookkeeping), ~5-7 ms for
a decode step's pieces on the H200 of benchmarks/results/gpu_h200_2026-12-04_second; planning, packing and
processing the previous step's tokens come on top when one thread does everything. JAX releases the GIL while an
executable is launched, so with JVLLM_DISPATCH_THREAD=1 a step's calls run on one dispatch thread, in the order the
engine started them, while the engine thread goes on (reading the previous step's tokens, planning the next).
Default off: the GPU measurement that would make it the default has not been made."""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable

DISPATCH_THREAD_ENV = "JVLLM_DISPATCH_THREAD"


def dispatch_thread_asked() -> bool:
    """Whether JVLLM_DISPATCH_THREAD asks for a dispatch thread ("1"; "0" or unset: no)."""
    value = os.environ.get(DISPATCH_THREAD_ENV, "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{DISPATCH_THREAD_ENV}={value!r}: expected 1 (a dispatch thread) or 0 (none)")
    return value == "1"


class Launch:
    """A started launch: its result (the step's device outputs) once the host has dispatched every call of it."""

    def __init__(self, future: concurrent.futures.Future | None = None, value: Any = None) -> None:
        self._future, self._value = future, value

    def result(self) -> Any:
        """Wait for the dispatch (not for the device); re-raises what the launch raised."""
        return self._value if self._future is None else self._future.result()


class StepLauncher:
    """Runs launches (callables that dispatch one step's device calls) one after another in the order given, on a
    thread of their own when `threaded`, else at once on the caller's thread."""

    def __init__(self, threaded: bool) -> None:
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jvllm-dispatch")
                      if threaded else None)

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def launch(self, dispatch: Callable[[], Any]) -> Launch:
        if self._pool is None:
            return Launch(value=dispatch())
        return Launch(self._pool.submit(dispatch))

    def close(self) -> None:
        """Let the launches already started finish, then end the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
