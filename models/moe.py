"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): top-k routing, token choices grouped by expert,
each group through its expert's MLP, outputs weighted and summed back per token.

The grouped products (`expert_implementation`) are the Pallas grouped-matmul kernel on a GPU (`expert_mlp_pallas`); on
XLA CPU, whose ragged_dot runs ~50x slower than a dense matmul of the same active size
(docs/design/models_and_outputs.md), a loop over (expert, row tile) work items, each three small dots against one
expert's weights (`expert_mlp_tiles`); `jax.lax.ragged_dot` elsewhere. Under tensor parallelism the kernel runs per
device in a shard_map (`sharded_routed_experts`): GSPMD does not partition a pallas_call.

Expert weights are stacked, [E, in, out]. Their HF tensors are one per expert; an HF name holding
`models.hf_names.EXPERT` stands for all of them, each expert's [out, in] tensor transposed and stacked."""
from __future__ import annotations

import functools
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from models.config import MoEConfig
from models.hf_names import EXPERT
from models.layers import MLP, Linear, mlp_hf_parameters
from models.params import normal_param
from pallas_kernels.grouped_matmul import MIN_BLOCK, grouped_matmul, work_items

EXPERTS_ENV = "JVLLM_MOE_EXPERTS"  # pallas | ragged | tiles: forces the grouped products (read at trace time)
TP_AXIS = "tp"  # the mesh axis that splits "expert_mlp" (jvllm.parallel.mesh.LOGICAL_AXIS_RULES)
# (rows [R, D] sorted by expert, gate, up [E, D, F], down [E, F, D], group_sizes [E]) -> [R, D] float32
ExpertProducts = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


class SparseMoE(nnx.Module):
    """x [T, D] -> [T, D]: sum over each token's top-k experts of weight * down(silu(gate(x)) * up(x)), plus a
    sigmoid-gated shared expert when the config has one."""

    def __init__(self, d: int, moe: MoEConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        e, f = moe.num_experts, moe.intermediate_size
        self.router = Linear(d, e, bias=False, dtype=dtype, rngs=rngs)
        self.gate_experts = normal_param(rngs, (e, d, f), dtype)
        self.up_experts = normal_param(rngs, (e, d, f), dtype)
        self.down_experts = normal_param(rngs, (e, f, d), dtype)
        self.top_k, self.normalize_top_k, self.num_experts = moe.top_k, moe.normalize_top_k, e
        shared = moe.shared_intermediate_size
        self.shared = MLP(d, shared, dtype, rngs) if shared else None
        self.shared_gate = Linear(d, 1, bias=False, dtype=dtype, rngs=rngs) if shared else None

    def __call__(self, x: jax.Array, mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
        """`mesh`: the tensor-parallel mesh the layer's attention runs on (None on one device); the Pallas
        products then run per device (`sharded_routed_experts`), the others are partitioned by GSPMD."""
        k = self.top_k
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = jax.lax.top_k(probs, k)  # [T, k] each
        if self.normalize_top_k:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat_experts = experts.reshape(-1)  # [T*k]: token t's choices at t*k .. t*k + k - 1
        order = jnp.argsort(flat_experts, stable=True)  # [T*k] grouped by expert
        token_of = order // k  # [T*k] the token each grouped row belongs to
        row_weights = weights.reshape(-1)[order]  # [T*k] each grouped row's routing weight
        group_sizes = jnp.bincount(flat_experts, length=self.num_experts).astype(jnp.int32)  # [E]
        implementation = expert_implementation()
        routed = functools.partial(routed_experts, EXPERT_PRODUCTS[implementation])
        if mesh is not None and implementation == "pallas":
            routed = sharded_routed_experts(routed, mesh)
        stacks = (self.gate_experts[...], self.up_experts[...], self.down_experts[...])
        y = routed(x, token_of, row_weights, group_sizes, *stacks)  # [T, D] float32
        if self.shared is not None:
            gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))  # [T, 1]
            y = y + gate * self.shared(x).astype(jnp.float32)
        return y.astype(x.dtype)

    def hf_parameters(self, prefix: str, expert_projections: tuple[str, str, str]) -> Iterator:
        """(parameter, HF name, transposed, logical axes) for the router, the expert stacks (names holding
        EXPERT, already [E, in, out]) and the shared expert. `expert_projections`: the HF names of gate, up and
        down (w1, w3, w2 for Mixtral)."""
        yield self.router.kernel, prefix + "gate.weight", True, ("embed", None)
        gate, up, down = expert_projections
        experts = prefix + f"experts.{EXPERT}."
        yield self.gate_experts, experts + gate + ".weight", False, (None, "embed", "expert_mlp")
        yield self.up_experts, experts + up + ".weight", False, (None, "embed", "expert_mlp")
        yield self.down_experts, experts + down + ".weight", False, (None, "expert_mlp", "embed")
        if self.shared is not None:
            yield from mlp_hf_parameters(self.shared, prefix + "shared_expert.", "shared_mlp")
            yield self.shared_gate.kernel, prefix + "shared_expert_gate.weight", True, ("embed", None)


def expert_implementation() -> str:
    """The grouped products a layer traced now runs: "pallas" on a GPU, "tiles" on XLA CPU, "ragged" elsewhere;
    JVLLM_MOE_EXPERTS forces one. "pallas" off a GPU runs the kernel in interpret mode, and JVLLM_PALLAS_INTERPRET=0
    lowers it compiled (pallas_kernels.common.default_interpret)."""
    forced = os.environ.get(EXPERTS_ENV, "")
    if forced:
        if forced not in EXPERT_PRODUCTS:
            raise ValueError(f"{EXPERTS_ENV}={forced!r}: expected one of {', '.join(EXPERT_PRODUCTS)}")
        return forced
    backend = jax.default_backend()
    return "pallas" if backend == "gpu" else "tiles" if backend == "cpu" else "ragged"


def routed_experts(products: ExpertProducts, x: jax.Array, token_of: jax.Array, row_weights: jax.Array,
                   group_sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """x [T, D]; token_of, row_weights [T*k] per row grouped by expert; group_sizes [E]; gate, up [E, D, F],
    down [E, F, D] -> [T, D] float32: each token's rows through their experts, weighted and summed."""
    out = products(x[token_of], gate, up, down, group_sizes)  # [T*k, D] float32
    return jnp.zeros(x.shape, jnp.float32).at[token_of].add(out * row_weights[:, None])


def sharded_routed_experts(routed: Callable[..., jax.Array], mesh: Mesh | AbstractMesh) -> Callable[..., jax.Array]:
    """`routed` (routed_experts' signature) per device over the mesh's "tp" axis. The mesh comes with the layer's
    attention (jvllm.parallel.ops.ShardedLayerAttention.mesh), the one shard_map already runs on. Each device holds
    every expert's slice of the intermediate width (gate/up columns, down rows; the weights arrive so): its
    [T, D] result is a partial sum over that slice, and one psum completes it. The routing is replicated."""
    columns = PartitionSpec(None, None, TP_AXIS)  # gate, up [E, D, F / tp]
    rows = PartitionSpec(None, TP_AXIS, None)  # down [E, F / tp, D]
    whole = PartitionSpec()

    def local(x: jax.Array, token_of: jax.Array, row_weights: jax.Array, group_sizes: jax.Array, gate: jax.Array,
              up: jax.Array, down: jax.Array) -> jax.Array:
        return jax.lax.psum(routed(x, token_of, row_weights, group_sizes, gate, up, down), TP_AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(whole, whole, whole, whole, columns, columns, rows),
                         out_specs=whole, check_vma=False)


def _silu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """x [R, D] through one expert (gate, up [D, F], down [F, D]) -> [R, D] float32."""
    def dot(a: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("rd,df->rf", a.astype(w.dtype), w, preferred_element_type=jnp.float32)

    hidden = jax.nn.silu(dot(x, gate)) * dot(x, up)  # [R, F] float32
    return dot(hidden.astype(x.dtype), down)


def expert_mlp_ragged(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                      group_sizes: jax.Array) -> jax.Array:
    """rows [R, D] sorted by expert; stacks gate, up [E, D, F], down [E, F, D]; group_sizes [E] -> [R, D] f32."""
    def grouped(a: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(a.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32)

    hidden = jax.nn.silu(grouped(rows, gate)) * grouped(rows, up)  # [R, F] float32
    return grouped(hidden.astype(rows.dtype), down)


def _aligned(rows: jax.Array, gate: jax.Array, up: jax.Array,
             down: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """D and F zero-padded to multiples of the kernel's 16 (no change for real models' widths): padded F columns
    give silu(0) * 0 = 0 hidden units, padded D columns products that are sliced off."""
    width, hidden = gate.shape[1:]
    pad_d, pad_f = -width % MIN_BLOCK, -hidden % MIN_BLOCK
    if not (pad_d or pad_f):
        return rows, gate, up, down
    rows = jnp.pad(rows, ((0, 0), (0, pad_d)))  # [R, D']
    gate, up = (jnp.pad(w, ((0, 0), (0, pad_d), (0, pad_f))) for w in (gate, up))  # [E, D', F']
    return rows, gate, up, jnp.pad(down, ((0, 0), (0, pad_f), (0, pad_d)))  # down [E, F', D']


def expert_mlp_pallas(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                      group_sizes: jax.Array) -> jax.Array:
    """expert_mlp_ragged's result from three launches of the Pallas grouped-matmul kernel (gate, up, down)."""
    width = rows.shape[1]
    rows, gate, up, down = _aligned(rows, gate, up, down)

    def grouped(a: jax.Array, w: jax.Array) -> jax.Array:
        return grouped_matmul(a.astype(w.dtype), w, group_sizes)

    hidden = jax.nn.silu(grouped(rows, gate)) * grouped(rows, up)  # [R, F'] float32
    return grouped(hidden.astype(rows.dtype), down)[:, :width]


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per work item: about half an expert's average share, a power of two in [8, 128]."""
    share = max(num_rows // (2 * num_experts), 1)
    return min(max(1 << (share.bit_length() - 1), 8), 128)


def expert_mlp_tiles(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                     group_sizes: jax.Array) -> jax.Array:
    """expert_mlp_ragged's result from a loop over the (expert, row tile) pairs the groups touch: each reads one
    expert's weights once for its tile; rows of a tile that belong to another expert are dropped."""
    num_rows, width = rows.shape
    block = tile_rows(num_rows, gate.shape[0])
    num_tiles = -(-num_rows // block)
    padded = jnp.pad(rows, ((0, num_tiles * block - num_rows), (0, 0)))  # [R', D]
    item_group, item_tile, count = work_items(group_sizes, num_tiles, block)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)

    def item(i: jax.Array, out: jax.Array) -> jax.Array:
        expert, first = item_group[i], item_tile[i] * block
        y = _silu_mlp(jax.lax.dynamic_slice_in_dim(padded, first, block), gate[expert], up[expert], down[expert])
        row = first + jnp.arange(block)
        mine = (row >= starts[expert]) & (row < ends[expert])  # [block]
        current = jax.lax.dynamic_slice_in_dim(out, first, block)
        return jax.lax.dynamic_update_slice_in_dim(out, current + jnp.where(mine[:, None], y, 0.0), first, 0)

    out = jax.lax.fori_loop(0, count, item, jnp.zeros((num_tiles * block, width), jnp.float32))
    return out[:num_rows]


EXPERT_PRODUCTS: dict[str, ExpertProducts] = {"pallas": expert_mlp_pallas, "ragged": expert_mlp_ragged,
                                              "tiles": expert_mlp_tiles}
