"""The `pallas` and `mosaic` backends: write the step's K/V into the pages, then attend over pages only with Pallas
kernels: the Triton ones (`pallas`), or the Mosaic GPU ones for Hopper (`mosaic`, where they cover the model: 16-bit,
head dim a multiple of 64; the Triton kernels otherwise)."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import numpy as np

from models.attention import AttentionMetadata
from pallas_kernels import mosaic_common, mosaic_decode, mosaic_ragged, mosaic_ragged_ws
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv
from pallas_kernels.ragged_attention import ragged_block_q, ragged_items, ragged_paged_attention


# the mosaic backend's ragged kernel: warp_specialized (default; 1.2-1.3x the other on an H200) | one_warpgroup
MOSAIC_RAGGED_ENV = "JVLLM_MOSAIC_RAGGED"


def mosaic_ragged_kernel(head_dim: int) -> tuple[int, Callable[..., jax.Array]]:
    """-> (queries per work item, kernel): the Mosaic GPU ragged kernel JVLLM_MOSAIC_RAGGED picks (read when the
    engine builds its steps), the one-warpgroup kernel where the warp-specialized one does not cover the head dim."""
    choice = os.environ.get(MOSAIC_RAGGED_ENV, "warp_specialized")
    if choice not in ("one_warpgroup", "warp_specialized"):
        raise ValueError(f"{MOSAIC_RAGGED_ENV}={choice!r}: one_warpgroup or warp_specialized")
    if choice == "warp_specialized" and mosaic_ragged_ws.covers(head_dim):
        return mosaic_ragged_ws.BLOCK_Q, mosaic_ragged_ws.mosaic_ragged_ws_attention
    return mosaic_ragged.BLOCK_Q, mosaic_ragged.mosaic_ragged_paged_attention


def _on_mosaic(kernels: str, q_dtype: Any, kv_dtype: Any, heads: int, kv_heads: int, head_dim: int,
               page_size: int) -> bool:
    return kernels == "mosaic" and mosaic_common.covers(q_dtype, kv_dtype, heads, kv_heads, head_dim, page_size)


def write_and_attend(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] donated by the caller's jit
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    *,
    kernels: str = "triton",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (out [T, H, hd] in q.dtype, k_pages, v_pages). Decode steps (row s is token s) take the decode kernel,
    the others the ragged kernel over the host's work items; `kernels` "mosaic" picks the Mosaic GPU ones where
    they cover the step. `interpret` defaults to True off GPU (JVLLM_PALLAS_INTERPRET=1/0 forces it on/off)."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, md.slot_mapping, interpret=interpret)
    mosaic = _on_mosaic(kernels, q.dtype, k_pages.dtype, q.shape[1], k_pages.shape[2], q.shape[2], k_pages.shape[1])
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    if md.decode:
        decode = mosaic_decode.mosaic_decode_attention if mosaic else decode_attention
        out = decode(q, k_pages, v_pages, md.page_tables, md.kv_lens, scale=scale, **options)
    else:
        ragged = mosaic_ragged_kernel(q.shape[2])[1] if mosaic else ragged_paged_attention
        out = ragged(q, k_pages, v_pages, md.query_start, md.q_lens, md.kv_lens, md.page_tables,
                     md.layout["item_seq"], md.layout["item_first"], scale=scale, **options)
    return out.astype(q.dtype), k_pages, v_pages


def ragged_layout(q_lens: np.ndarray, query_start: np.ndarray, cached: np.ndarray, num_tokens: int, num_seqs: int,
                  *, block_q: int) -> dict[str, np.ndarray]:
    """Host side of a prefill step: the ragged kernel's work items (`block_q` queries of one sequence each)."""
    del query_start, cached  # the kernel reads them from the metadata
    item_seq, item_first = ragged_items(q_lens, block_q, num_tokens, num_seqs)
    return {"item_seq": item_seq, "item_first": item_first}


def layout_for(num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any, *, kernels: str = "triton") -> Any:
    """The prefill layout of a model: items of the block size the ragged kernel will launch with (the engine's page
    size is a multiple of 8 under `mosaic`: EngineArgs checks it)."""
    if _on_mosaic(kernels, dtype, dtype, num_heads, num_kv_heads, head_dim, page_size=8):
        return functools.partial(ragged_layout, block_q=mosaic_ragged_kernel(head_dim)[0])
    return functools.partial(ragged_layout, block_q=ragged_block_q(dtype, dtype, num_heads, num_kv_heads, head_dim))
