"""Commands from the callers' threads to AsyncEngine's engine thread: add, abort, stop."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable

from jvllm.engine.status import EngineDeadError
from jvllm.sampling_params import SamplingParams


@dataclasses.dataclass
class Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    loop: asyncio.AbstractEventLoop
    future: concurrent.futures.Future  # set when the engine has queued the request (or refused it)
    priority: int = 0


@dataclasses.dataclass
class Abort:
    request_id: str
    loop: asyncio.AbstractEventLoop | None = None  # the reader's loop, told when the abort is done


Command = Add | Abort


class CommandQueue:
    """Thread-safe: any thread submits, the engine thread takes everything queued at once between steps."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._commands: list[Command] = []
        self.stopping = False
        self._exited = False  # set by the engine thread, under the lock, as its last act

    def submit(self, command: Command) -> None:
        with self._cv:
            if self._exited:
                if isinstance(command, Add):
                    raise EngineDeadError("the engine is not running")
                return  # nothing left to abort
            self._commands.append(command)
            self._cv.notify()

    def has_adds(self) -> bool:
        """(Any thread.) Whether a request is queued that the engine thread has not taken yet."""
        with self._cv:
            return any(isinstance(command, Add) for command in self._commands)

    def stop(self) -> None:
        with self._cv:
            self.stopping = True
            self._cv.notify()

    def take(self, *, idle: bool, heartbeat_s: float | None, heartbeat: Callable[[], None],
             burst_cap_s: float, burst_gap_s: float) -> tuple[list[Command], bool]:
        """(Engine thread.) -> (the queued commands, whether to stop). An idle engine sleeps until a command or
        a stop arrives (calling `heartbeat` every `heartbeat_s` meanwhile); then, if requests are arriving, it
        waits while more keep coming (each within `burst_gap_s`, at most `burst_cap_s`) so that a burst of
        clients shares one prefill step instead of the first running alone."""
        with self._cv:
            while idle and not self._commands and not self.stopping:
                if not self._cv.wait(timeout=heartbeat_s):
                    heartbeat()
            if idle and any(isinstance(c, Add) for c in self._commands):
                self._gather_burst(burst_cap_s, burst_gap_s)
            commands, self._commands = self._commands, []
            return commands, self.stopping

    def _gather_burst(self, cap_s: float, gap_s: float) -> None:
        """(Lock held.) Return at the first quiet gap, the cap, or a stop."""
        deadline = time.monotonic() + cap_s
        seen = len(self._commands)
        while not self.stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cv.wait(timeout=min(gap_s, remaining))
            if len(self._commands) == seen:
                return
            seen = len(self._commands)

    def close(self) -> list[Command]:
        """(Engine thread, last act.) Refuse further commands; -> those queued since the last `take`."""
        with self._cv:
            self._exited = True
            leftover, self._commands = self._commands, []
            return leftover
