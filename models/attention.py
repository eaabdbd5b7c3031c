"""The host-kernel contract: per-step attention metadata, the per-layer attention call a model makes, and
how a KV pool's dtype tells the values it holds."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

# A bfloat16 pool may be stored as its uint16 bits (the `xla` backend does, see jvllm.attention.pool_storage).
BF16_BITS = jnp.dtype(jnp.uint16)
# 8-bit float pools (kv_cache_dtype "fp8_e5m2") hold values the model computes with in bfloat16
EIGHT_BIT_POOLS = (jnp.dtype(jnp.float8_e5m2),)

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: (k_pages, v_pages), each [N, page, KVH, hd]
# (q [T, H, hd], k/v [T, KVH, hd], (k_pages, v_pages), md, scale, sliding_window, soft_cap)
#   -> (out [T, H, hd], layer result):
# the layer result is whatever the backend needs after the step (its new pages, or the K/V still to write).
LayerAttention = Callable[..., tuple[jax.Array, Any]]


def attention_mesh(attention: LayerAttention) -> Any:
    """The tensor-parallel mesh a layer attention runs its shards on (its `mesh` attribute), None on one device:
    the layer's other per-device pieces (the MoE experts' Pallas kernel) run on the same mesh."""
    return getattr(attention, "mesh", None)


def value_dtype(pool_dtype: Any) -> jnp.dtype:
    """The dtype the model computes in over a pool of `pool_dtype`: the values it holds (bfloat16 for its bits,
    and for 8-bit floats)."""
    if jnp.dtype(pool_dtype) == BF16_BITS or jnp.dtype(pool_dtype) in EIGHT_BIT_POOLS:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(pool_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """One step's tokens and sequences. T (tokens) and S (sequence rows) are fixed by the step's shape, P by
    max_model_len; nothing else varies. Tokens are flat: sequence s owns tokens query_start[s] .. + q_lens[s].
    Padding rows have q_len 0; padding tokens write to the reserved page 0 and are never read back.

    `decode` (static): every row is one token and row s is token s (T == S). `layout` holds the attention
    backend's own work arrays for the other steps, built on the host (jvllm.attention.backend.prefill_layout)."""

    slot_mapping: jax.Array  # [T] int32: page * page_size + offset where each token's K/V goes
    query_start: jax.Array  # [S] int32: flat index of each sequence's first token
    q_lens: jax.Array  # [S] int32: tokens computed this step (0 for padding rows)
    kv_lens: jax.Array  # [S] int32: context length after this step (cached + new)
    page_tables: jax.Array  # [S, P] int32: page ids of each sequence (0 past its pages)
    layout: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    decode: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def last_token_index(self) -> jax.Array:
        """[S] int32 flat index of each sequence's last token this step (its logits are sampled)."""
        return self.query_start + jnp.maximum(self.q_lens - 1, 0)

    @property
    def cached_lens(self) -> jax.Array:
        """[S] int32 tokens already in the pages before this step."""
        return self.kv_lens - self.q_lens
