"""In-process reuse of compiled executables: a second engine of the same model, shapes and devices in one process
takes the first one's executables instead of compiling (or loading from the persistent cache) again. Kept within
the process's memory-map limit, which XLA CPU executables use up fast."""
from __future__ import annotations

import collections
import gc
import hashlib
import logging
import threading
import time
from typing import Any

import jax

logger = logging.getLogger("jvllm")

# XLA CPU maps each kernel of an executable (code, constants, data) separately: ~80 memory maps per step
# executable, measured on SmolLM2 (docs/design/step_shapes.md). Linux refuses mmap past vm.max_map_count (65530 by
# default) and XLA then crashes the process.
MAPS_PER_EXECUTABLE = 80
DEFAULT_MAX_MAP_COUNT = 65530
MEMO_SHARE = 0.25  # of the map limit, for executables the memo alone keeps alive
RECLAIM_AT = 0.5  # maps in use, as a share of the limit, past which the memo lets go and garbage is collected
WARN_AT = 0.7

_memo: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_lock = threading.Lock()
# Counting the maps reads /proc/self/maps, which the kernel writes out line by line: ~3 ms at 4,000 maps, more in a
# process holding tens of thousands. Between counts each compile is assumed to add up to MAPS_PER_COMPILE_BOUND (a
# generous bound on what an executable maps), so a count is taken only once that could cross the reclaim line, and
# at least every RECOUNT_EVERY compiles (maps also come from elsewhere).
MAPS_PER_COMPILE_BOUND = 500
RECOUNT_EVERY = 32
MAP_LIMIT_TTL_S = 10.0  # vm.max_map_count is read again after this many seconds

_warned = False
_next_reclaim = 0  # maps in use past which the next reclaim runs (0: at RECLAIM_AT of the limit)
_counted: int | None = None  # the last count of the maps in use (None: none yet)
_compiles_since_count = 0
_map_limit: tuple[float, int] | None = None  # (when read, vm.max_map_count)
hits = 0  # executables taken from the memo in this process


def compile_once(lowered: jax.stages.Lowered, module: str | None = None) -> Any:
    """`lowered.compile()`, or the executable an earlier call compiled from the same module for the same
    devices. Lowering already ran, so the key is exact: the module text (weights are arguments, never
    constants) plus the devices each input and output lives on and the arguments' shapes and pytree. `module`,
    where the caller has one, names the module instead of its text: a digest of what it was lowered from, whose
    equal lowers to the equal module (a stored module called with these arguments: ~6 ms a piece less than
    printing the text)."""
    key = _key(lowered, module)
    if key is None:
        return lowered.compile()
    found = remembered(key)
    if found is not None:
        return found
    _keep_maps_in_bounds()
    compiled = lowered.compile()
    remember(key, compiled)
    return compiled


def remembered(key: tuple) -> Any | None:
    """The executable kept under `key` (compile_once's keys, or a caller's own that names exactly what was
    compiled), or None."""
    global hits
    with _lock:
        found = _memo.get(key)
        if found is not None:
            _memo.move_to_end(key)
            hits += 1
        return found


def remember(key: tuple, compiled: Any) -> None:
    """Keep `compiled` under `key`, within the memo's capacity (the least recently used go first)."""
    with _lock:
        _memo[key] = compiled
        while len({id(kept) for kept in _memo.values()}) > capacity():  # an executable may be kept under two keys
            _memo.popitem(last=False)


def clear() -> None:
    """Forget every executable (they stay alive in the engines that hold them)."""
    with _lock:
        _memo.clear()


def max_map_count() -> int:
    """vm.max_map_count, read again at most every MAP_LIMIT_TTL_S seconds (a limit raised while a server runs
    counts)."""
    global _map_limit
    now = time.monotonic()
    if _map_limit is None or now - _map_limit[0] > MAP_LIMIT_TTL_S:
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                _map_limit = (now, int(f.read()))
        except (OSError, ValueError):
            _map_limit = (now, DEFAULT_MAX_MAP_COUNT)
    return _map_limit[1]


def maps_in_use() -> int | None:
    """Memory maps this process holds (Linux), else None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def capacity() -> int:
    """Executables the memo keeps: MEMO_SHARE of the map limit."""
    return max(16, int(max_map_count() * MEMO_SHARE) // MAPS_PER_EXECUTABLE)


def _keep_maps_in_bounds() -> None:
    """Before a compile: past RECLAIM_AT of the map limit, drop the memo and collect garbage (engines no longer
    referenced but caught in reference cycles free their executables); past WARN_AT after that, say so once."""
    global _warned, _next_reclaim, _counted, _compiles_since_count
    limit = max_map_count()
    line = max(RECLAIM_AT * limit, _next_reclaim)
    if (_counted is not None and _compiles_since_count < RECOUNT_EVERY
            and _counted + MAPS_PER_COMPILE_BOUND * (_compiles_since_count + 1) < line):
        _compiles_since_count += 1
        return
    used = _counted = maps_in_use()
    _compiles_since_count = 0
    if used is None or used < line:
        return
    clear()
    gc.collect()
    used = _counted = maps_in_use() or 0
    _next_reclaim = used + 0.1 * limit  # live engines alone may hold this many: no reclaim per compile
    if used >= WARN_AT * limit and not _warned:
        _warned = True
        logger.warning("this process holds %d of its %d memory maps (vm.max_map_count); each compiled step holds "
                       "~%d and the process crashes when they run out: delete engines no longer used, or raise "
                       "vm.max_map_count", used, limit, MAPS_PER_EXECUTABLE)


def _key(lowered: jax.stages.Lowered, module: str | None = None) -> tuple | None:
    """(module digest or the caller's name of it, device ids of every input and output, argument shapes, input and
    output pytrees), or None where the devices cannot be read. The pytrees count: equal modules can take differently
    structured (static) arguments."""
    try:
        args = lowered._lowering.compile_args
        shardings = list(args["in_shardings"]) + list(args["out_shardings"])
        devices = tuple(tuple(d.id for d in s._device_assignment) for s in shardings
                        if hasattr(s, "_device_assignment"))
        if args.get("host_callbacks"):
            return None  # a callback is bound to the function object that was traced
        backend = getattr(args.get("backend"), "platform", str(args.get("backend")))
    except (AttributeError, KeyError, TypeError):
        return None
    digest = ("text", hashlib.sha256(lowered.as_text().encode()).hexdigest()) if module is None else ("named", module)
    # every argument's shape: arguments the computation does not read are pruned from the module text, but the
    # executable still checks them
    arguments = tuple((a.shape, str(a.dtype), a.donated) for a in jax.tree.leaves(lowered.args_info))
    return digest, backend, devices, arguments, lowered.in_tree, lowered.out_tree
