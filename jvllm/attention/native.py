"""The `cpu` backend's attention: the native ragged paged-attention kernel (cpu_kernels) over the read-only pool."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from cpu_kernels.paged_attention import HEAD_DIM_MULTIPLE, paged_attention as native_paged_attention
from jvllm.attention.backend import AttentionBackend, SeparateWrite
from models.attention import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class NativeCpu(SeparateWrite):
    """SeparateWrite over the native kernel; a model whose head_dim the kernel does not take gets `fallback`."""

    fallback: Callable[[], AttentionBackend] | None = None

    @property
    def mixes_decode_rows(self) -> bool:
        return True  # one kernel walks any mix of chunk lengths

    def for_model(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any) -> AttentionBackend:
        if head_dim % HEAD_DIM_MULTIPLE and self.fallback is not None:
            return self.fallback()
        return self


def no_layout(q_lens: np.ndarray, query_start: np.ndarray, cached: np.ndarray, num_tokens: int,
              num_seqs: int) -> dict[str, np.ndarray]:
    """The kernel walks the metadata's flat tokens itself: a prefill step needs no work arrays."""
    return {}


def paged_attention(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys (not yet in the pages)
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] read only (float32, or bfloat16 stored as bits)
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of each query over its sequence's cached pages plus this step's chunk -> [T, H, hd]."""
    out = native_paged_attention(q, k, v, k_pages, v_pages, md.query_start, md.q_lens, md.kv_lens, md.page_tables,
                                 scale, sliding_window, soft_cap)
    return out.astype(q.dtype)
