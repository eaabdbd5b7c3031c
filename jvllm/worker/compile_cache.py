"""Turns on JAX's persistent compilation cache so a second start skips XLA compilation."""
from __future__ import annotations

import jax

from jvllm.model_loader.loader import cache_root

_enabled = False


def enable_compilation_cache() -> str:
    """Idempotent; returns the cache directory (JVLLM_CACHE_DIR/xla, default ~/.cache/jvllm/xla)."""
    global _enabled
    directory = str(cache_root() / "xla")
    if not _enabled:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _enabled = True
    return directory
