"""The `pallas` backend: write the step's K/V into the pages, then attend over pages only with Pallas kernels."""
from __future__ import annotations

import jax

from models.attention import AttentionMetadata
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv
from pallas_kernels.ragged_attention import ragged_paged_attention


def write_and_attend(
    q: jax.Array,  # [T, H, hd]
    k: jax.Array,  # [T, KVH, hd] this step's keys
    v: jax.Array,  # [T, KVH, hd]
    k_pages: jax.Array,  # [N, page, KVH, hd] donated by the caller's jit
    v_pages: jax.Array,  # [N, page, KVH, hd]
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (out [T, H, hd] in q.dtype, k_pages, v_pages). A Q bucket of 1 (every q_len <= 1, known at trace
    time) takes the decode kernel; anything else the ragged kernel. `interpret` defaults to True off GPU
    (JVLLM_PALLAS_INTERPRET=1/0 forces it on/off)."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, md.slot_mapping, interpret=interpret)
    max_q = md.seq_token_index.shape[1]
    if max_q == 1:
        q_seq = q[md.seq_token_index[:, 0]]  # [S, H, hd]; padded rows read token 0 and have kv_len 0
        out_seq = decode_attention(q_seq, k_pages, v_pages, md.page_tables, md.kv_lens, scale=scale,
                                   sliding_window=sliding_window, interpret=interpret)
        out = out_seq[md.token_seq]  # [T, H, hd]
    else:
        out = ragged_paged_attention(q, k_pages, v_pages, md.query_start, md.q_lens, md.kv_lens, md.page_tables,
                                     max_q_len=max_q, scale=scale, sliding_window=sliding_window,
                                     interpret=interpret)
    return out.astype(q.dtype), k_pages, v_pages
