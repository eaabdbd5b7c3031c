"""How many lead rows of a step's activations are real tokens: set around a layer, read by the native products."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

# (live row count [] int32, the step's row count T) while a layer of a step is traced; None outside one.
_LIVE: contextvars.ContextVar[tuple[jax.Array, int] | None] = contextvars.ContextVar("live_rows", default=None)


@contextlib.contextmanager
def live_rows(count: jax.Array, rows: int) -> Iterator[None]:
    """Within: products over `rows` rows (a step's padded tokens, real ones first) may skip the rows from `count` on
    and leave them 0 (jvllm.worker.step_functions sets it around each layer: count = the step's tokens)."""
    token = _LIVE.set((count, rows))
    try:
        yield
    finally:
        _LIVE.reset(token)


def live_rows_of(rows: int) -> jax.Array | None:
    """The live count for an operand of `rows` rows, or None (all rows) outside a layer or for other row counts."""
    current = _LIVE.get()
    return current[0] if current is not None and current[1] == rows else None
