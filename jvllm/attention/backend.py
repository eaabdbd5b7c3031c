"""The one interface the runner sees: per-layer attention inside the step, and storing the step's K/V after it.

Two ways to get there. `InStepWrite` (the GPU kernels) writes each layer's K/V into its pages inside the step's
jit, which donates the pool, and attends over pages only. `SeparateWrite` (XLA CPU) attends over the read-only
pool plus the step's own K/V, and scatters that K/V into the donated pool in a jit of its own afterwards: a jit
that both gathers from and scatters into the pool makes XLA CPU copy the whole pool every step."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Protocol

import jax
from jax.sharding import Mesh

from jvllm.parallel import ops
from jvllm.utils import cdiv
from models.attention import AttentionMetadata, KVCache, LayerAttention


class AttendFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 md: AttentionMetadata, scale: float, sliding_window: int | None = None) -> jax.Array: ...


class WriteFn(Protocol):
    def __call__(self, kv_cache: KVCache, new_kv: list, md: AttentionMetadata) -> KVCache: ...


class WriteAttendFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 md: AttentionMetadata, scale: float,
                 sliding_window: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]: ...


StoreFn = Callable[[KVCache, list, AttentionMetadata], KVCache]


def _same_dtype(dtype: Any) -> Any:
    return dtype


@dataclasses.dataclass(frozen=True)
class AttentionBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def layer_attention(self, mesh: Mesh | None = None) -> LayerAttention:
        """The call a model makes per layer: (q [T,H,hd], k/v [T,KVH,hd], (k_pages, v_pages), md, scale,
        sliding_window) -> (out [T,H,hd], a per-layer result for `store`); per shard with a mesh."""

    @abc.abstractmethod
    def store(self, mesh: Mesh | None = None) -> StoreFn:
        """(pool, per-layer results, md) -> the pool holding the step's K/V; run after every step."""

    @property
    @abc.abstractmethod
    def step_donates_pool(self) -> bool:
        """Whether the step's jit takes the pool donated (it returns the new pool itself)."""

    @abc.abstractmethod
    def table_pages(self, cached_tokens: int, step_tokens: int, page_size: int) -> int:
        """How many of a sequence's pages its page table must list for a chunk of `step_tokens` after
        `cached_tokens` (pages past the ones listed are never read this step)."""

    def pool_dtype(self, dtype: Any) -> Any:
        """The dtype a pool holding values of the model's `dtype` is stored in."""
        return dtype


@dataclasses.dataclass(frozen=True)
class InStepWrite(AttentionBackend):
    write_and_attend: WriteAttendFn  # (q, k, v, k_pages, v_pages, md, scale, window) -> (out, k_pages, v_pages)

    def layer_attention(self, mesh: Mesh | None = None) -> LayerAttention:
        def attention(q, k, v, pages, md, scale, sliding_window=None):
            out, k_pages, v_pages = self.write_and_attend(q, k, v, pages[0], pages[1], md, scale, sliding_window)
            return out, (k_pages, v_pages)
        return attention if mesh is None else ops.sharded_layer_attention(attention, mesh, (ops.PAGES, ops.PAGES))

    def store(self, mesh: Mesh | None = None) -> StoreFn:
        return lambda kv_cache, new_pages, md: new_pages  # written in the step already

    @property
    def step_donates_pool(self) -> bool:
        return True

    def table_pages(self, cached_tokens: int, step_tokens: int, page_size: int) -> int:
        return cdiv(cached_tokens + step_tokens, page_size)


@dataclasses.dataclass(frozen=True)
class SeparateWrite(AttentionBackend):
    attend: AttendFn  # (q, k, v, k_pages, v_pages, md, scale, window) -> out, the pool read only
    write: WriteFn  # (pool, per-layer (k, v) [T,KVH,hd], md) -> pool
    storage_dtype: Callable[[Any], Any] = _same_dtype  # model dtype -> pool dtype

    def layer_attention(self, mesh: Mesh | None = None) -> LayerAttention:
        def attention(q, k, v, pages, md, scale, sliding_window=None):
            return self.attend(q, k, v, pages[0], pages[1], md, scale, sliding_window), (k, v)
        return attention if mesh is None else ops.sharded_layer_attention(attention, mesh, (ops.KV, ops.KV))

    def store(self, mesh: Mesh | None = None) -> StoreFn:
        write = self.write if mesh is None else ops.sharded_pool_write(self.write, mesh)
        return jax.jit(write, donate_argnums=(0,))

    @property
    def step_donates_pool(self) -> bool:
        return False

    def table_pages(self, cached_tokens: int, step_tokens: int, page_size: int) -> int:
        return cdiv(cached_tokens, page_size)  # the step's own K/V is attended to directly

    def pool_dtype(self, dtype: Any) -> Any:
        return self.storage_dtype(dtype)


__all__ = ["AttendFn", "AttentionBackend", "InStepWrite", "SeparateWrite", "StoreFn", "WriteAttendFn", "WriteFn"]
