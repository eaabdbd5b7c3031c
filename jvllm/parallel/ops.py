"""Per-shard pieces of the sharded step: attention and the KV write (shard_map over KV heads), the
vocab-parallel embedding lookup, and replicated logits for the sampler. Matmuls are left to GSPMD (except the MoE
experts' Pallas kernel: models.moe runs it in a shard_map on the attention's mesh)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jvllm.parallel.mesh import LOGICAL_AXIS_RULES, partition_spec

try:  # jax >= 0.7 has the public jax.shard_map; older releases only the experimental one
    _shard_map = jax.shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
except AttributeError:  # pragma: no cover - jax < 0.7
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
        return _experimental_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)

HEADS = partition_spec(("tokens", "heads", "head_dim"))  # q and the attention output [T, H, hd]
KV = partition_spec(("tokens", "kv_heads", "head_dim"))  # a step's k / v [T, KVH, hd]
PAGES = partition_spec(("pages", "page_slot", "kv_heads", "head_dim"))  # the pool [N, page, KVH, hd]
REPLICATED = PartitionSpec()
VOCAB_AXIS = LOGICAL_AXIS_RULES["vocab"]


@dataclasses.dataclass(frozen=True)
class ShardedLayerAttention:
    """A layer's attention run on each device's own heads: q by heads, k/v and pages by KV heads, the metadata
    replicated. Nothing is gathered: each shard's query heads use only that shard's KV heads. `result`: the
    partition specs of the attention's per-layer result (new pages, or the step's k/v). The model reads `mesh`
    (models.attention.attention_mesh) to run its other per-device pieces, the MoE experts' kernel, on it too."""

    attention: Callable
    mesh: Mesh
    result: Any

    def __call__(self, q, k, v, pages, md, scale, sliding_window=None, soft_cap=None):
        def local(q, k, v, pages, md):
            return self.attention(q, k, v, pages, md, scale, sliding_window, soft_cap)
        return shard_map(local, self.mesh, in_specs=(HEADS, KV, KV, (PAGES, PAGES), REPLICATED),
                         out_specs=(HEADS, self.result))(q, k, v, pages, md)


def sharded_layer_attention(attention: Callable, mesh: Mesh, result: Any) -> ShardedLayerAttention:
    return ShardedLayerAttention(attention, mesh, result)


def sharded_pool_write(write: Callable, mesh: Mesh) -> Callable:
    """(kv_cache, new_kv, md) -> kv_cache with each device scattering its own KV heads into its pages."""
    return shard_map(write, mesh, in_specs=(PAGES, KV, REPLICATED), out_specs=PAGES)


def vocab_parallel_lookup(mesh: Mesh) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """(table [V, D] split by vocab rows, ids [T]) -> [T, D] replicated: each shard looks up the ids in its
    row range (zeros elsewhere), then one all-reduce sums them; the table is never gathered."""
    def local(table: jax.Array, ids: jax.Array) -> jax.Array:
        rows = table.shape[0]  # V / tp
        local_ids = ids - jax.lax.axis_index(VOCAB_AXIS) * rows
        inside = (local_ids >= 0) & (local_ids < rows)
        x = table[jnp.clip(local_ids, 0, rows - 1)]  # [T, D]
        return jax.lax.psum(jnp.where(inside[:, None], x, jnp.zeros_like(x)), VOCAB_AXIS)

    return shard_map(local, mesh, in_specs=(PartitionSpec(VOCAB_AXIS, None), REPLICATED), out_specs=REPLICATED)


def gather_vocab(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    """Logits [S, V]: pinned split by vocab where the LM head makes them (so the partitioner cannot choose to
    gather the [D, V] head instead), then all-gathered for the sampler, which needs every row whole."""
    split = NamedSharding(mesh, PartitionSpec(None, VOCAB_AXIS))
    whole = NamedSharding(mesh, REPLICATED)
    return lambda logits: jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(logits, split), whole)


def replicate(mesh: Mesh) -> Callable[[Any], Any]:
    """Constrain a pytree to be replicated on every device (logits for the sampler: one [S, V] gather)."""
    sharding = NamedSharding(mesh, REPLICATED)
    return lambda tree: jax.lax.with_sharding_constraint(tree, sharding)
