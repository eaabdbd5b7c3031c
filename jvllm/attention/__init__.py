"""Attention backend registry. A backend attends over the read-only page pool plus a step's new K/V, and
writes that K/V into the pool (the runner calls the write in a separate jit with the pool donated)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax

from jvllm.attention.metadata import AttentionMetadata


class AttendFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 md: AttentionMetadata, scale: float, sliding_window: int | None = None) -> jax.Array: ...


class WriteFn(Protocol):
    def __call__(self, kv_cache: list, new_kv: list, md: AttentionMetadata) -> list: ...


class WriteAttendFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 md: AttentionMetadata, scale: float,
                 sliding_window: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """Either split (`attend` reads the pool, `write` runs later in its own donated jit: best on XLA CPU) or
    fused (`write_and_attend` writes the step's K/V into the pages, then attends over pages only, inside
    one jit that donates the pool: the GPU kernels' shape)."""

    name: str
    attend: AttendFn | None  # (q [T,H,hd], k/v [T,KVH,hd], pages [N,page,KVH,hd], md, scale) -> [T,H,hd]
    write: WriteFn | None  # (per-layer pages, per-layer (k, v) [T,KVH,hd], md) -> per-layer pages
    write_and_attend: WriteAttendFn | None = None  # (q, k, v, k_pages, v_pages, md, scale) -> (out, k_pages, v_pages)
    pool_dtype: Callable[[Any], Any] = lambda dtype: dtype  # model dtype -> the dtype its pool is stored in

    @property
    def fused(self) -> bool:
        return self.write_and_attend is not None


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, loader: Callable[[], AttentionBackend]) -> None:
    """Register a backend by name; `loader` imports it lazily so optional backends cost nothing."""
    _BACKENDS[name] = loader


def _load_xla() -> AttentionBackend:
    from jvllm.attention import pool_storage, xla

    return AttentionBackend("xla", xla.paged_attention, xla.write_layers, pool_dtype=pool_storage.storage_dtype)


def _load_pallas() -> AttentionBackend:
    from jvllm.attention import pallas

    return pallas.backend()


register_backend("xla", _load_xla)
register_backend("pallas", _load_pallas)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str) -> str:
    """'auto' is pallas on GPU when registered, else xla."""
    if name == "auto":
        on_gpu = jax.default_backend() == "gpu"
        return "pallas" if on_gpu and "pallas" in _BACKENDS else "xla"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; available: {', '.join(['auto', *available_backends()])}")
    return name


def get_backend(name: str) -> AttentionBackend:
    return _BACKENDS[resolve_backend_name(name)]()


__all__ = ["AttendFn", "WriteAttendFn", "AttentionBackend", "AttentionMetadata", "WriteFn", "available_backends", "get_backend",
           "register_backend", "resolve_backend_name"]
