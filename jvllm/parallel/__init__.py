"""Tensor parallelism: the device mesh, sharded weight loading, per-shard kernels and multi-host steps."""
from jvllm.parallel.mesh import LOGICAL_AXIS_RULES, check_tensor_parallel_size, make_mesh, partition_spec

__all__ = ["LOGICAL_AXIS_RULES", "check_tensor_parallel_size", "make_mesh", "partition_spec"]
