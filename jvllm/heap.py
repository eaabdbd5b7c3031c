"""Freed heap memory handed back to the OS (glibc's malloc_trim): glibc keeps what its arenas freed for reuse, so
after a large transient allocation (a model load's staging copies, a large request body) the process would otherwise
stay at its peak resident size."""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on other C libraries."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()


def release_freed_memory() -> None:
    """Return free heap pages of every arena to the OS (tens of ms on a GB-sized heap; no effect without glibc)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
