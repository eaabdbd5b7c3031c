"""Whole KV pages copied inside the pool: a request that starts from a cached partial page (a tail,
jvllm.core.kv_pages) writes into its own copy of it."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.parallel import ops

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer (K, V) pages [N, page, KVH, hd]


def copy_pages(pool: KVCache, sources: jax.Array, targets: jax.Array) -> KVCache:
    """sources, targets [C] int32 page ids -> the pool with page targets[i] holding page sources[i]'s slots.
    Padding entries copy the reserved page 0 onto itself. Rows of the flat [N * page, KVH, hd] view are gathered
    and scattered, which XLA CPU does in place on a donated pool of 4-byte or uint16 values (the CPU pools)."""
    def copied(pages: jax.Array) -> jax.Array:
        num_pages, page_size, kv_heads, head_dim = pages.shape
        flat = pages.reshape(num_pages * page_size, kv_heads, head_dim)
        slots = jnp.arange(page_size, dtype=jnp.int32)
        rows = (sources[:, None] * page_size + slots).reshape(-1)  # [C * page]
        slots = (targets[:, None] * page_size + slots).reshape(-1)
        return flat.at[slots].set(flat[rows]).reshape(pages.shape)

    return [(copied(k), copied(v)) for k, v in pool]


def page_copier(mesh: Mesh | None) -> Any:
    """copy_pages jitted with the pool donated (kept sharded by KV head on a mesh)."""
    if mesh is None:
        return jax.jit(copy_pages, donate_argnums=(0,))
    pages = NamedSharding(mesh, ops.PAGES)
    return jax.jit(copy_pages, donate_argnums=(0,), out_shardings=pages)


def copy_list(copies: list[tuple[int, int]], size: int) -> np.ndarray:
    """(source, target) page pairs -> [2, size] int32, padded with the reserved page copied onto itself."""
    if len(copies) > size:
        raise ValueError(f"{len(copies)} page copies in one step, at most {size}")
    pairs = np.zeros((2, size), np.int32)
    if copies:
        pairs[:, :len(copies)] = np.asarray(copies, np.int32).T
    return pairs
