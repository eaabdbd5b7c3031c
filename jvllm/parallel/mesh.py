"""The ("dp", "tp") device mesh, the logical-axis -> mesh-axis table, and size checks with helpful errors."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("dp", "tp")  # dp is always 1 for now: room for data parallelism later

# Every sharded dimension names a logical axis; this one table decides which mesh axis splits it.
# Column-parallel q/k/v/gate/up split their output (heads, kv_heads, mlp), row-parallel o/down their input,
# the embedding and the LM head the vocabulary; the KV pool splits by KV head like k/v.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": "tp",
    "embed": None,
    "heads": "tp",  # q_proj columns / o_proj rows (heads x head_dim, whole heads per shard)
    "kv_heads": "tp",  # k/v_proj columns and the KV pool's head axis
    "mlp": "tp",
    "expert_mlp": "tp",  # each expert's intermediate columns (gate/up) and rows (down): every device holds every expert
    "shared_mlp": "tp",  # the shared expert's intermediate width (Qwen2-MoE)
    "head_dim": None,
    "tokens": None,
    "pages": None,
    "page_slot": None,
}

# Logical axes whose size is padded with zeros up to a multiple of tp (exact: see sharding.py).
PADDABLE_AXES = ("vocab", "mlp", "expert_mlp", "shared_mlp")


def partition_spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
    """('embed', 'heads') -> PartitionSpec(None, 'tp'); None or an unknown-to-the-mesh axis is replicated."""
    return PartitionSpec(*(LOGICAL_AXIS_RULES.get(a) if a is not None else None for a in logical_axes))


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def make_mesh(tp: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A (1, tp) mesh over the first tp devices (all processes' devices, process-major, when multi-host)."""
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(tp, len(devices))
    if jax.process_count() > 1 and tp != len(devices):
        raise ValueError(f"with {jax.process_count()} hosts tensor_parallel_size must use every device: "
                         f"tensor_parallel_size={tp} but there are {len(devices)} devices in all")
    # Auto axes: the partitioner propagates the weights' shardings through the matmuls (no sharding in types)
    return Mesh(np.array(devices[:tp]).reshape(1, tp), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_device_count(tp: int, device_count: int) -> None:
    if tp > device_count:
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tp} (set before jax starts) "
                f"gives {tp} virtual devices" if jax.default_backend() == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={tp} exceeds jax.device_count()={device_count}{hint}")


def working_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """TP sizes that split whole query heads and either split or replicate whole KV heads."""
    return [n for n in range(1, num_heads + 1)
            if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)]


def check_tensor_parallel_size(tp: Any, num_heads: int, num_kv_heads: int) -> None:
    """ValueError naming the sizes that work when tp cannot split this model's attention heads."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    sizes = ", ".join(map(str, working_sizes(num_heads, num_kv_heads)))
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={num_heads}; "
                         f"sizes that work: {sizes}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={num_kv_heads} or be a "
                         f"multiple of it (KV heads are then replicated); sizes that work: {sizes}")


def put_replicated(tree: Any, mesh: Mesh) -> Any:
    """Host (numpy) leaves -> arrays replicated on every mesh device; every process passes the same values."""
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                               lambda index: np.asarray(x)[index]), tree)


def host_array(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this host, also when the array spans other processes' devices."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))
