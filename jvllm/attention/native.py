"""The `cpu` backend's attention: the native ragged paged-attention kernel (cpu_kernels), which writes each layer's
K/V into its (donated) pages and attends in one call."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.paged_attention import DIRECT_QUERIES, HEAD_DIM_MULTIPLE, paged_attention_write
from jvllm.attention.backend import AttentionBackend, InStepWrite
from jvllm.attention.pool_storage import BITS, as_stored, as_values, storage_dtype
from models.attention import EIGHT_BIT_POOLS, AttentionMetadata
from models.quantized import bf16_products_enabled, invariant_rows


@dataclasses.dataclass(frozen=True)
class NativeCpu(InStepWrite):
    """InStepWrite over the native kernel; a model whose head_dim the kernel does not take gets `fallback`.

    Each layer's kernel call stores the step's K/V in that layer's pages (aliased in place) before attending, so no
    pool-write jit runs after the layers (docs/design/cpu_attention.md, "Native CPU attention"). The step's own keys
    are read from the layer's k/v, so a fresh chunk attends to itself whatever its pages hold (prompt_logits lists
    only the reserved page 0)."""

    fallback: Callable[[], AttentionBackend] | None = None

    @property
    def attends_step_kv(self) -> bool:
        return True

    def pool_dtype(self, dtype: Any) -> Any:
        return storage_dtype(dtype)

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


def write_and_attend(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] donated (float32, bfloat16 stored as bits, or float8_e5m2)
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's K/V stored at md.slot_mapping, then causal attention of each query over its sequence's cached
    pages plus this step's chunk -> (out [T, H, hd], k_pages, v_pages). Prefill blocks over bfloat16 pages round
    queries and probabilities to bfloat16 where the step's products round their activations
    (models.quantized.bf16_products); a sequence of up to the step's invariant rows of queries takes the direct loops,
    which give each query the bits it would get alone. Over 8-bit pages every key and value is attended as the pages
    keep it, the step's own included (rounded here), so that a prompt's outputs do not depend on which of its pages
    came from the prefix cache or an earlier chunk."""
    k_store, v_store = _to_store(k, k_pages.dtype), _to_store(v, v_pages.dtype)
    if k_pages.dtype in EIGHT_BIT_POOLS:
        k, v = as_values(k_store), as_values(v_store)
    out, k_pages, v_pages = paged_attention_write(
        q, k, v, k_store, v_store, k_pages, v_pages, md.query_start,
        md.q_lens, md.kv_lens, md.page_tables, md.slot_mapping, scale, sliding_window, soft_cap,
        bf16_tiles=bf16_products_enabled(), direct_queries=max(DIRECT_QUERIES, invariant_rows()))
    return out.astype(q.dtype), k_pages, v_pages


def _to_store(values: jax.Array, pool_dtype: Any) -> jax.Array:
    """The step's K or V as the kernel takes them to store: float32 values for a bfloat16 pool, which the kernel
    rounds as it writes them (in XLA the rounding is one more pass over them), else as the pool stores them."""
    if values.dtype == jnp.float32 and jnp.dtype(pool_dtype) == BITS:
        return values
    return as_stored(values, pool_dtype)
