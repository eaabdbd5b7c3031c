"""A CPU model's weights backed by 2 MiB pages where Linux allows it.

A CPU decode step streams every weight once: ~97 MB for the embedded model, ~24,000 pages of 4 KiB, each a TLB entry
to walk for. XLA's CPU buffers come from malloc, which gets huge pages only by chance (where it reuses memory that
NumPy had advised for them: docs/design/host_loop.md, huge pages). Here each buffer's 2 MiB-aligned ranges are advised
for huge pages (`MADV_HUGEPAGE`) and collapsed into them at once (`MADV_COLLAPSE`, Linux 6.1+; with the transparent
huge pages setting "madvise", the default of many distributions). Where either call is refused (another OS, an older
kernel, huge pages "never") the buffers stay as they were: only speed is at stake. The KV pool keeps its pages:
collapsing its ~1 GB costs seconds at start for no measured gain."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Iterable

import jax

HUGE_PAGE = 2 << 20  # bytes
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def _madvise():
    """libc's madvise(addr, length, advice) -> 0 or -1, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_ranges(buffers: Iterable[tuple[int, int]]) -> list[int]:
    """(address, bytes) of host buffers -> the start of every 2 MiB-aligned range that one of them overlaps, each
    once, in order. The model's many small buffers (a layer's projection: 70-550 KB) lie side by side, so their
    ranges are shared; a range may reach into neighbouring memory of the same mapping, which collapsing backs with
    the huge page too."""
    starts: set[int] = set()
    for address, size in buffers:
        if size <= 0:
            continue
        start = address // HUGE_PAGE * HUGE_PAGE
        while start < address + size:
            starts.add(start)
            start += HUGE_PAGE
    return sorted(starts)


def host_buffers(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU shard of `arrays` (others, and arrays without a buffer, are skipped)."""
    found = []
    for array in arrays:
        for shard in getattr(array, "addressable_shards", ()):
            if shard.device.platform != "cpu":
                continue
            try:
                found.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
            except (AttributeError, RuntimeError, ValueError):  # deleted, donated or not a plain buffer
                continue
    return found


def back_with_huge_pages(arrays: Iterable[jax.Array]) -> int:
    """Advise and collapse the 2 MiB ranges of the CPU buffers of `arrays` -> bytes now in huge pages (0 where the
    OS refuses)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    collapsed = 0
    for start in huge_page_ranges(host_buffers(arrays)):
        madvise(start, HUGE_PAGE, MADV_HUGEPAGE)
        if madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0:
            collapsed += HUGE_PAGE
    return collapsed
