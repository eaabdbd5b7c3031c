"""Python's cyclic garbage collector around the engine: paused while an engine starts; then, in a process jvllm
owns (its command line, a server), the start-up heap moved out of its reach for good, and in a library caller's,
moved to the oldest generation before the first request.

A full collection walks every tracked object. After start-up a process holds ~600k of them (jax, transformers,
the model, the traced and compiled steps) and only ~100 of them are cyclic garbage, yet each full collection
takes ~0.35-0.5 s with the GIL held: left alone, `jvllm generate` meets eight of them while it starts and one at
exit (~1.6 s of ~6.5 s), and a busy server one about every 30 s, stalling every step and stream in flight."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_freeze_after_start_up = False


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
    jvllm owns, the heap is frozen; in a library caller's, it is made old (`settle_heap`)."""
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
    """Move every tracked object into the oldest generation without walking it (`gc.freeze` then `gc.unfreeze`,
    each O(1)); collectable there as any old object. Skipped when the caller froze objects of its own, which
    `gc.unfreeze` would release.

    Left young, the start-up heap would be walked by the first collections after start-up, inside the caller's
    first batch or burst of requests: a middle-generation one (~0.3 s), which promotes it, and then the full one
    that the promotion brings due (~0.4 s: Python runs a full collection once the objects promoted since the last
    one exceed a quarter of those it found alive then). Moved this way it is never counted as promoted, and a
    full collection (one per engine start, were it collected instead) comes only as the caller's own work adds up."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def freeze_start_up_heap() -> None:
    """Collect once, then move every object alive now out of the collector's reach (`gc.freeze`). For a process
    that will serve until it exits."""
    gc.collect()
    gc.freeze()
