"""Turns on JAX's persistent compilation cache so a second start skips XLA compilation."""
from __future__ import annotations

import pathlib

import jax

from jvllm.model_loader.loader import cache_root

_enabled = False
_disabled = False


def disable_in_this_process() -> None:
    """Keep this process off the persistent cache: every compile runs, nothing is loaded or stored. The test
    suite does this for its own processes (engines it starts in subprocesses still use the cache): there, a
    long-lived process building hundreds of engines loaded entries often enough to meet a segfault inside jaxlib
    0.10.2's executable deserialization now and then (docs/design/step_shapes.md)."""
    global _disabled
    _disabled = True


def enable_compilation_cache() -> str:
    """Idempotent; returns the cache directory (JVLLM_CACHE_DIR/xla, default ~/.cache/jvllm/xla)."""
    global _enabled
    directory = str(cache_root() / "xla")
    if not _enabled and not _disabled:
        jax.config.update("jax_compilation_cache_dir", directory)
        # Every piece, however quickly it compiles: the engine has many small pieces (~40 ms each), and loading
        # one is cheaper than compiling it again at every start.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _enabled = True
    return directory


def exported_pieces_root() -> pathlib.Path | None:
    """Where engines keep their exported step pieces (jvllm.worker.exported_pieces): JVLLM_CACHE_DIR/exported, or
    None where the persistent cache is not on in this process."""
    return cache_root() / "exported" if _enabled and not _disabled else None
