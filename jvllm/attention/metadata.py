"""Per-step attention metadata: where a flat, ragged token batch lives in the paged KV pool."""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Device arrays describing one step. T = token bucket, S = sequence bucket, Q = max query bucket,
    P = page bucket. Padding tokens write to the reserved page 0 and are never read back."""

    slot_mapping: jax.Array  # [T] int32: page * page_size + offset where each token's K/V goes
    token_seq: jax.Array  # [T] int32: which sequence row each flat token belongs to
    token_offset: jax.Array  # [T] int32: its index within that sequence's query chunk
    seq_token_index: jax.Array  # [S, Q] int32: flat index of each sequence's q-th token (0 when padded)
    query_start: jax.Array  # [S] int32: flat index of each sequence's first token (cu_q_lens[:-1])
    q_lens: jax.Array  # [S] int32: tokens computed this step (0 for padded rows)
    kv_lens: jax.Array  # [S] int32: context length after this step (cached + new)
    block_tables: jax.Array  # [S, P] int32: page ids of each sequence (0 when padded)

    @property
    def last_token_index(self) -> jax.Array:
        """[S] int32 flat index of each sequence's last token this step (its logits are sampled)."""
        return self.query_start + jax.numpy.maximum(self.q_lens - 1, 0)
