"""Python's cyclic garbage collector around the engine: paused while an engine starts; then, in a process jvllm
owns (its command line, a server), the start-up heap moved out of its reach for good, and in a library caller's,
collected once so that it is old before the first request; while the engine steps, young collections spaced out so
that a step's short-lived objects die before any collection sees them.

A full collection walks every tracked object. After start-up a process holds ~600k of them (jax, transformers,
the model, the traced and compiled steps) and only ~100 of them are cyclic garbage, yet each full collection
takes ~0.35-0.5 s with the GIL held: left alone, `jvllm generate` meets eight of them while it starts and one at
exit (~1.6 s of ~6.5 s), and a busy server one about every 30 s, stalling every step and stream in flight."""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_freeze_after_start_up = False

# Tracked objects (net of those freed) that start a young collection while an engine steps; Python's default is
# 700 (2,000 from 3.13). A step builds ~10 per row of its batch and frees them all when it ends, so this covers
# a step of a few thousand rows.
STEPPING_YOUNG_THRESHOLD = 50_000
_stepping_lock = threading.Lock()
_stepping_depth = 0
_saved_threshold: tuple[int, ...] | None = None


def own_process() -> None:
    """Declares the process jvllm's own (the `jvllm` command, `entrypoints.command`): an engine that starts in it
    freezes the heap it built (`gc.freeze`), so that later collections, the one at exit included, walk only what
    came after. Not for a library caller's process: a frozen object is never collected, even once it is unreachable
    garbage (an engine the caller dropped, caught in a cycle, would keep its KV pool)."""
    global _freeze_after_start_up
    _freeze_after_start_up = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (usable as a decorator): start-up builds a large, long-lived heap with
    almost no cycles, and collecting while it grows only walks it again and again. On the way out, in a process
    jvllm owns, the heap is frozen; in a library caller's, it is collected once (`settle_heap`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _freeze_after_start_up:
            gc.freeze()  # O(1): the generations' lists are moved, not walked
        elif was_enabled:
            settle_heap()
        if was_enabled:
            gc.enable()


def settle_heap() -> None:
    """One full collection now, so that the start-up heap is the old generation's, counted as long-lived.

    Left young, the heap would be walked by the first collections after start-up: a middle-generation one
    (~0.3 s) and then a full one (~0.4 s), since Python runs a full collection once the objects promoted since
    the last one exceed a quarter of those it found alive then, and no full collection has counted the heap yet.
    They would come due inside the caller's first batch or burst of requests. Collected here, the heap sets that
    quarter at ~150k objects, and later full collections are rare. (Moving the heap to the oldest generation
    unwalked, with `gc.freeze()` and `gc.unfreeze()`, would spare the ~0.4 s but never count it: full collections
    would then come so seldom that engines a caller dropped, caught in cycles, kept their memory.) The collection
    also frees what engines dropped earlier left."""
    gc.collect()


def freeze_start_up_heap() -> None:
    """Collect once, then move every object alive now out of the collector's reach (`gc.freeze`). For a process
    that will serve until it exits."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def young_collections_spaced() -> Iterator[None]:
    """While inside (nested or from several threads: the outermost exit restores), the young generation collected
    only past STEPPING_YOUNG_THRESHOLD tracked objects instead of Python's default.

    With the default, a step of many rows starts young collections while its plans, row specs and results are
    alive (~3 a step at 256 rows); they survive into the older generations, and once those promotions pass a
    quarter of the long-lived heap Python walks the whole heap, ~0.25 s with the GIL held, about every 130 steps
    at 256 rows. The engine's steps leave no cyclic garbage (`tests/jvllm/test_collector.py`), so collecting
    less often keeps nothing alive that a collection would free; a caller's own cycles made meanwhile wait for
    the raised threshold. A threshold of 0 (automatic collection disabled) or one the caller raised further is
    left as it is, and one the caller changed meanwhile is not restored over."""
    global _stepping_depth, _saved_threshold
    with _stepping_lock:
        if _stepping_depth == 0:
            current = gc.get_threshold()
            if 0 < current[0] < STEPPING_YOUNG_THRESHOLD:
                _saved_threshold = current
                gc.set_threshold(STEPPING_YOUNG_THRESHOLD, *current[1:])
        _stepping_depth += 1
    try:
        yield
    finally:
        with _stepping_lock:
            _stepping_depth -= 1
            if _stepping_depth == 0 and _saved_threshold is not None:
                if gc.get_threshold() == (STEPPING_YOUNG_THRESHOLD, *_saved_threshold[1:]):
                    gc.set_threshold(*_saved_threshold)
                _saved_threshold = None
