"""The one interface the runner sees: per-layer attention inside the step, and storing the step's K/V after it.

Two ways to get there. `InStepWrite` (the GPU kernels, the native CPU kernel) writes each layer's K/V into its
pages inside the step's jit, which donates the pool. `SeparateWrite` (XLA CPU) attends over the read-only pool
plus the step's own K/V, and scatters that K/V into the donated pool in a jit of its own afterwards: a jit
that both gathers from and scatters into the pool makes XLA CPU copy the whole pool every step (a custom call
that takes the pages aliased to its outputs does not)."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

import numpy as np

from jvllm.parallel import ops
from models.attention import AttentionMetadata, KVCache, LayerAttention


class AttendFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 md: AttentionMetadata, scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None) -> jax.Array: ...


class WriteFn(Protocol):
    def __call__(self, kv_cache: KVCache, new_kv: list, md: AttentionMetadata) -> KVCache: ...


class WriteAttendFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 md: AttentionMetadata, scale: float,
                 sliding_window: int | None = None,
                 soft_cap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]: ...


StoreFn = Callable[[KVCache, list, AttentionMetadata], KVCache]
# (q_lens [n], query_start [n], cached_lens [n], num_tokens T, num_seqs S) -> the backend's work arrays for one
# prefill step (AttentionMetadata.layout): numpy, fixed shapes for a given (T, S).
PrefillLayout = Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], dict[str, np.ndarray]]


def _same_dtype(dtype: Any) -> Any:
    return dtype


@dataclasses.dataclass(frozen=True)
class AttentionBackend(abc.ABC):
    name: str
    prefill_layout: PrefillLayout  # the host builds the backend's work arrays of each prefill step with it

    @abc.abstractmethod
    def layer_attention(self, mesh: Mesh | None = None) -> LayerAttention:
        """The call a model makes per layer: (q [T,H,hd], k/v [T,KVH,hd], (k_pages, v_pages), md, scale,
        sliding_window, soft_cap) -> (out [T,H,hd], a per-layer result for `store`); per shard with a mesh."""

    @abc.abstractmethod
    def store(self, mesh: Mesh | None = None) -> StoreFn:
        """(pool, per-layer results, md) -> the pool holding the step's K/V; run after every step."""

    @property
    @abc.abstractmethod
    def step_donates_pool(self) -> bool:
        """Whether the step's jit takes the pool donated (it returns the new pool itself)."""

    @abc.abstractmethod
    def layer_result_sharding(self, mesh: Mesh) -> Any:
        """How a layer's attention result is laid out over a tensor-parallel mesh (by KV head)."""

    def pool_dtype(self, dtype: Any) -> Any:
        """The dtype a pool holding values of the model's `dtype` is stored in."""
        return dtype

    @property
    def attends_step_kv(self) -> bool:
        """Whether a layer attends to this step's K/V from its own k/v (not from the pages), so a fresh chunk's
        attention does not depend on what its pages hold."""
        return not self.step_donates_pool

    @property
    def mixes_decode_rows(self) -> bool:
        """Whether a prefill step attends one-token (decode) rows as cheaply as a decode step does, so the runner
        may put decode rows and prefill chunks in one step."""
        return False

    def for_model(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any) -> AttentionBackend:
        """This backend set up for a model's attention shapes (a backend whose work layout depends on them)."""
        return self


@dataclasses.dataclass(frozen=True)
class InStepWrite(AttentionBackend):
    write_and_attend: WriteAttendFn  # (q, k, v, k_pages, v_pages, md, scale, window, cap) -> (out, k_pages, v_pages)
    layout_for: Callable[..., PrefillLayout] | None = None  # (heads, kv_heads, head_dim, dtype) -> prefill layout

    def for_model(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any) -> AttentionBackend:
        if self.layout_for is None:
            return self
        return dataclasses.replace(self, prefill_layout=self.layout_for(num_heads, num_kv_heads, head_dim, dtype))

    def layer_attention(self, mesh: Mesh | None = None) -> LayerAttention:
        def attention(q, k, v, pages, md, scale, sliding_window=None, soft_cap=None):
            out, k_pages, v_pages = self.write_and_attend(q, k, v, pages[0], pages[1], md, scale, sliding_window,
                                                          soft_cap)
            return out, (k_pages, v_pages)
        return attention if mesh is None else ops.sharded_layer_attention(attention, mesh, (ops.PAGES, ops.PAGES))

    def store(self, mesh: Mesh | None = None) -> StoreFn:
        return lambda kv_cache, new_pages, md: new_pages  # written in the step already

    @property
    def step_donates_pool(self) -> bool:
        return True

    def layer_result_sharding(self, mesh: Mesh) -> Any:
        return (NamedSharding(mesh, ops.PAGES), NamedSharding(mesh, ops.PAGES))  # the layer's new pages


@dataclasses.dataclass(frozen=True)
class SeparateWrite(AttentionBackend):
    attend: AttendFn  # (q, k, v, k_pages, v_pages, md, scale, window, cap) -> out, the pool read only
    write: WriteFn  # (pool, per-layer (k, v) [T,KVH,hd], md) -> pool
    storage_dtype: Callable[[Any], Any] = _same_dtype  # model dtype -> pool dtype

    def layer_attention(self, mesh: Mesh | None = None) -> LayerAttention:
        def attention(q, k, v, pages, md, scale, sliding_window=None, soft_cap=None):
            return self.attend(q, k, v, pages[0], pages[1], md, scale, sliding_window, soft_cap), (k, v)
        return attention if mesh is None else ops.sharded_layer_attention(attention, mesh, (ops.KV, ops.KV))

    def store(self, mesh: Mesh | None = None) -> StoreFn:
        write = self.write if mesh is None else ops.sharded_pool_write(self.write, mesh)
        return jax.jit(write, donate_argnums=(0,))

    @property
    def step_donates_pool(self) -> bool:
        return False

    def layer_result_sharding(self, mesh: Mesh) -> Any:
        return (NamedSharding(mesh, ops.KV), NamedSharding(mesh, ops.KV))  # the step's k, v

    def pool_dtype(self, dtype: Any) -> Any:
        return self.storage_dtype(dtype)


__all__ = ["AttendFn", "AttentionBackend", "InStepWrite", "PrefillLayout", "SeparateWrite", "StoreFn", "WriteAttendFn",
           "WriteFn"]
