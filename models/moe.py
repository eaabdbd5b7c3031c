"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): top-k routing, token choices grouped by expert,
each group through its expert's MLP, outputs weighted and summed back per token.

The grouped products are `jax.lax.ragged_dot` except on XLA CPU, whose ragged_dot runs ~50x slower than a dense
matmul of the same active size (docs/design.md); there a loop walks (expert, row tile) work items, each three
small dots against one expert's weights (`expert_mlp_tiles`).

Expert weights are stacked, [E, in, out]. Their HF tensors are one per expert; an HF name holding
`models.hf_names.EXPERT` stands for all of them, each expert's [out, in] tensor transposed and stacked."""
from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import MoEConfig
from models.hf_names import EXPERT
from models.layers import MLP, Linear, mlp_hf_parameters
from models.params import normal_param
from pallas_kernels.grouped_matmul import work_items

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

    def __call__(self, x: jax.Array) -> jax.Array:
        tokens, k = x.shape[0], self.top_k
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = jax.lax.top_k(probs, k)  # [T, k] each
        if self.normalize_top_k:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat_experts = experts.reshape(-1)  # [T*k]: token t's choices at t*k .. t*k + k - 1
        order = jnp.argsort(flat_experts, stable=True)  # [T*k] grouped by expert
        token_of = order // k  # [T*k] the token each grouped row belongs to
        group_sizes = jnp.bincount(flat_experts, length=self.num_experts).astype(jnp.int32)  # [E]
        out = self._experts(x[token_of], group_sizes)  # [T*k, D] float32
        out = out * weights.reshape(-1)[order][:, None]
        y = jnp.zeros((tokens, x.shape[1]), jnp.float32).at[token_of].add(out)  # [T, D]
        if self.shared is not None:
            gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))  # [T, 1]
            y = y + gate * self.shared(x).astype(jnp.float32)
        return y.astype(x.dtype)

    def _experts(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """rows [R, D] sorted by expert, group_sizes [E] -> each row through its expert's MLP, [R, D] float32."""
        stacks = (self.gate_experts[...], self.up_experts[...], self.down_experts[...])
        if jax.default_backend() == "cpu":
            return expert_mlp_tiles(rows, *stacks, group_sizes)
        return expert_mlp_ragged(rows, *stacks, group_sizes)

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
