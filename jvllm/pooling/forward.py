"""The jitted pooled forward passes: [rows, length] token ids -> pooled embeddings [rows, D] (or a cross-encoder's
logits [rows, num_labels]), no KV kept.

Encoders run their own padded forward. Causal LMs run the paged-attention model over a throwaway one-slot
pool: every sequence is a first prefill chunk that attends to itself, so nothing is ever read from the pool."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.attention import get_backend
from models.attention import AttentionMetadata
from models.pooling import PoolingConfig, pool

# (flat weights, input_ids, positions, segments, token types [R, W] int32) -> embeddings [num_slots, D] float32.
# segments holds 1 + the output slot of each token's sequence (0 = padding): see jvllm.pooling.batching.pack_arrays.
EmbedFn = Callable[[list[jax.Array], jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _pooled(hidden: jax.Array, positions: jax.Array, segments: jax.Array, num_slots: int, mode: str) -> jax.Array:
    """hidden [R, W, D] -> each sequence's pooled row [num_slots, D] float32."""
    slots = jnp.where(segments > 0, segments - 1, num_slots).reshape(-1)  # [R * W]; padding -> dropped
    return pool(hidden.reshape(slots.shape[0], -1), slots, positions.reshape(-1), num_slots, mode)


def _finish(hidden: jax.Array, positions: jax.Array, segments: jax.Array, num_slots: int,
            pooling: PoolingConfig) -> jax.Array:
    """hidden [R, W, D] -> pooled [num_slots, D] float32 (normalized on the host, as each request asks:
    Embedder.outputs)."""
    return _pooled(hidden, positions, segments, num_slots, pooling.mode)


def build_encoder_forward(graphdef: Any, treedef: Any, pooling: PoolingConfig, num_slots: int) -> EmbedFn:
    """Rows may pack several sequences: attention stays within each segment."""
    @jax.jit
    def forward(weights: list[jax.Array], input_ids: jax.Array, positions: jax.Array, segments: jax.Array,
                token_types: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        return _finish(model(input_ids, segments, positions, token_types), positions, segments, num_slots, pooling)

    return forward


def build_classifier_forward(graphdef: Any, treedef: Any, num_slots: int) -> EmbedFn:
    """A cross-encoder (models.bert.BertForSequenceClassification): the classifier head on each sequence's first
    token -> logits [num_slots, num_labels] float32. Rows pack several sequences, as for encoder embeddings."""
    @jax.jit
    def forward(weights: list[jax.Array], input_ids: jax.Array, positions: jax.Array, segments: jax.Array,
                token_types: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        hidden = model(input_ids, segments, positions, token_types)  # [R, W, D]
        first = _pooled(hidden, positions, segments, num_slots, "cls")  # [S, D]
        return model.classify(first.astype(hidden.dtype))

    return forward


# Page tables of the throwaway pool: never read (no row has cached tokens), wide enough for the page loop.
_TABLE_WIDTH = 16


def padded_prefill_metadata(segments: jax.Array) -> AttentionMetadata:
    """Metadata for R right-padded rows of W tokens (one sequence each) laid out flat (row r's token j at
    r * W + j), each a first prefill chunk with no cached context, all in one chunk class of width W for the
    `xla` backend; every token writes to slot 0 of the throwaway pool."""
    rows, width = segments.shape
    flat = jnp.arange(rows * width, dtype=jnp.int32).reshape(rows, width)
    real = segments > 0
    q_lens = jnp.sum(real, axis=1).astype(jnp.int32)  # [R]
    layout = {f"index{width}": jnp.where(real, flat, rows * width), f"rows{width}": jnp.arange(rows, dtype=jnp.int32),
              f"count{width}": jnp.asarray(rows, jnp.int32)}
    return AttentionMetadata(
        slot_mapping=jnp.zeros(rows * width, jnp.int32),
        query_start=jnp.arange(rows, dtype=jnp.int32) * width,
        q_lens=q_lens,
        kv_lens=q_lens,
        page_tables=jnp.zeros((rows, _TABLE_WIDTH), jnp.int32),
        layout=layout,
    )


def build_causal_forward(graphdef: Any, treedef: Any, pooling: PoolingConfig, num_slots: int, num_layers: int,
                         num_kv_heads: int, head_dim: int, dtype: Any) -> EmbedFn:
    """One sequence per row (plan with share_rows=False): the paged attention masks by sequence, not segment."""
    attention = get_backend("xla").layer_attention()

    @jax.jit
    def forward(weights: list[jax.Array], input_ids: jax.Array, positions: jax.Array, segments: jax.Array,
                token_types: jax.Array) -> jax.Array:  # token types: unused (a causal LM has none)
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        rows, width = input_ids.shape
        pool_shape = (1, 1, num_kv_heads, head_dim)  # one page of one slot, masked out: cached length is 0
        kv_cache = [(jnp.zeros(pool_shape, dtype), jnp.zeros(pool_shape, dtype)) for _ in range(num_layers)]
        md = padded_prefill_metadata(segments)
        hidden, _ = model(input_ids.reshape(-1), positions.reshape(-1), kv_cache, md, attention)  # [R * W, D]
        return _finish(hidden.reshape(rows, width, -1), positions, segments, num_slots, pooling)

    return forward
