"""Request-supplied CPU work (tokenizing, chat templates) on a small thread pool, off the event loop."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sys
import time
from types import FrameType
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# Long lists are JSON-encoded this many items per call, so the encoder lets go of the GIL between pieces.
_JSON_PIECE_ITEMS = 16384
# Jinja compiles templates to Python code whose frames carry this file name.
_TEMPLATE_FILENAME = "<template>"


class TemplateTimeout(Exception):
    """A chat template ran past its time bound."""


class BlockingWork:
    """A bounded pool for work that would otherwise hold the event loop (HF tokenizers release the GIL
    while they encode, so /health and open streams keep answering)."""

    def __init__(self, workers: int | None = None) -> None:
        workers = workers or min(4, os.cpu_count() or 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jvllm-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """Run `fn` in this thread; Jinja template code it runs raises TemplateTimeout once `seconds` have
    passed (checked on every line the template executes, so loops cannot run on)."""
    deadline = time.monotonic() + seconds

    def on_line(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template ran longer than {seconds:g} s")
        return on_line

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def json_in_pieces(document: dict[str, Any]) -> bytes:
    """`json.dumps(document)` for a flat object whose values may be long lists, encoded piece by piece: one
    call over a million token ids would hold the GIL (and the event loop) for a few hundred milliseconds."""
    fields = []
    for key, value in document.items():
        if isinstance(value, list) and len(value) > _JSON_PIECE_ITEMS:
            pieces = [json.dumps(value[i:i + _JSON_PIECE_ITEMS], ensure_ascii=False)[1:-1]
                      for i in range(0, len(value), _JSON_PIECE_ITEMS)]
            encoded = "[" + ",".join(pieces) + "]"
        else:
            encoded = json.dumps(value, ensure_ascii=False)
        fields.append(f"{json.dumps(key)}:{encoded}")
    return ("{" + ",".join(fields) + "}").encode()
