"""Grammar compiles that cannot take the process down: each constraint is first compiled in a child process
(jvllm.structured.sandbox_worker) with a small stack, a memory cap and a time limit; only what survived there is
compiled here, on a thread whose stack is 16 times deeper (the compiler's recursion depends on the grammar alone)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

from jvllm.structured import sandbox_worker
from jvllm.structured.limits import GrammarLimits

T = TypeVar("T")
DEEP_STACK_BYTES = 256 << 20  # this process's compile thread: address space only, pages are touched as used
_START_TIMEOUT_S = 120.0  # python start-up, importing llguidance, reading the tokenizer
_CRASH_CAUSES = {"signal SIGSEGV": ": grammars nested too deeply overflow its stack",
                 "signal SIGABRT": ": grammars too large for its memory budget end it so"}


class CompileAborted(ValueError):
    """The sandbox gave up on a constraint: the child crashed on it or ran out of time."""


class GrammarSandbox:
    """A child process that compiles constraints for one tokenizer, started on first use and again after a
    crash or a timeout. One compile at a time; thread-safe."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_token_ids: list[int], limits: GrammarLimits):
        if limits.sandbox_stack_bytes * 4 > DEEP_STACK_BYTES:
            raise ValueError(f"the sandbox's stack ({limits.sandbox_stack_bytes} bytes) must stay well below this "
                             f"process's compile stack ({DEEP_STACK_BYTES} bytes)")
        self._setup = dict(tokenizer=tokenizer_json, n_vocab=n_vocab, eos=list(eos_token_ids),
                           parser_limits=limits.parser_settings(), stack_bytes=limits.sandbox_stack_bytes,
                           memory_bytes=limits.compile_memory_bytes)
        self._timeout_s = limits.compile_timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    def compile(self, kind: str, value: Any) -> str:
        """-> llguidance's grammar text for a constraint that compiled in the child; ValueError (the library's
        message, or what happened to the child) otherwise."""
        with self._lock:
            process = self._process or self._start()
            try:
                reply = self._ask(process, {"kind": kind, "value": value}, self._timeout_s)
            except TimeoutError:
                self._stop()
                raise CompileAborted(f"it took longer than {self._timeout_s:g} s") from None
            except EOFError:
                how = self._stop()
                raise CompileAborted(f"the grammar compiler crashed on it ({how}{_CRASH_CAUSES.get(how, '')})"
                                     ) from None
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["grammar"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-P", sandbox_worker.__file__], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self._finalizer = weakref.finalize(self, _kill, process)
        try:
            process.stdin.write(sandbox_worker.encode_message(self._setup))
            process.stdin.flush()
            reply = _read_reply(process, time.monotonic() + _START_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError) as error:
            _kill(process)
            raise ValueError(f"the grammar compiler process did not start ({type(error).__name__})") from None
        if not reply.get("ready"):
            _kill(process)
            raise ValueError(f"the grammar compiler process did not start: {reply.get('error', reply)}")
        self._process = process
        return process

    @staticmethod
    def _ask(process: subprocess.Popen, request: dict, timeout_s: float) -> dict:
        try:
            process.stdin.write(sandbox_worker.encode_message(request))
            process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise EOFError from None
        return _read_reply(process, time.monotonic() + timeout_s)

    def _stop(self) -> str:
        """Kill the child (if any) -> how it ended, e.g. "signal SIGSEGV"."""
        process, self._process = self._process, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return "not started" if process is None else _kill(process)


def _read_reply(process: subprocess.Popen, deadline: float) -> dict:
    header = _read_exactly(process.stdout.fileno(), 4, deadline)
    (size,) = struct.unpack(">I", header)
    return json.loads(_read_exactly(process.stdout.fileno(), size, deadline))


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
        piece = os.read(fd, size - len(data))
        if not piece:
            raise EOFError
        data += piece
    return bytes(data)


def _kill(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.kill()
    code = process.wait()
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except OSError:
            pass
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _DeepStackThread:
    """One daemon thread with a deep stack that runs submitted calls in order."""

    def __init__(self, stack_bytes: int):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(stack_bytes)
        try:
            threading.Thread(target=self._loop, name="jvllm-grammar-compile", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def run(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future.result()

    def _loop(self) -> None:
        while True:
            fn, future = self._calls.get()
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)


_deep_stack: _DeepStackThread | None = None
_deep_stack_lock = threading.Lock()


def run_with_deep_stack(fn: Callable[[], T]) -> T:
    """Run `fn` on the process's deep-stack compile thread (started on first use) and return its result."""
    global _deep_stack
    with _deep_stack_lock:
        if _deep_stack is None:
            _deep_stack = _DeepStackThread(DEEP_STACK_BYTES)
    return _deep_stack.run(fn)
