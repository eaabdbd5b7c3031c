"""The process heap around the engine (glibc): freed memory handed back to the OS after one-off peaks (malloc_trim),
and kept for reuse while steps run (mallopt).

glibc keeps what its arenas freed for reuse, so after a large transient allocation (a model load's staging copies, a
large request body) the process would otherwise stay at its peak resident size. The opposite holds for the steps:
glibc serves blocks of 32 MB and more (a 256-row step's logits over a 49k vocabulary: 50 MB) with fresh mmaps and
returns freed heap tops above a threshold at once, so left alone each step's large buffers come back as new pages,
every 4 KB faulted in and zeroed by the kernel. Allocators such as tcmalloc, which vLLM's CPU guide preloads, keep
such memory; `reuse_freed_memory` makes glibc do the same (docs/design/cpu_profiles.md has the measurements)."""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def _find_libc_function(name: str) -> Callable[..., int] | None:
    """A glibc function by name, or None on other C libraries."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_libc_function("malloc_trim")
_mallopt = _find_libc_function("mallopt")


def release_freed_memory() -> None:
    """Return free heap pages of every arena to the OS (tens of ms on a GB-sized heap; no effect without glibc)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def reuse_freed_memory() -> None:
    """From now on, serve every block from the heap (no per-block mmaps) and keep freed memory there for the next
    allocation instead of returning it to the OS (no effect without glibc; `release_freed_memory` still trims)."""
    if _mallopt is not None:
        _mallopt(_M_MMAP_MAX, 0)
        _mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
