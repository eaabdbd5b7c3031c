"""Packs a step's chunk rows into the host arrays of one step of a fixed shape (jvllm.worker.step_shapes)."""
from __future__ import annotations

import dataclasses

import numpy as np

from jvllm.attention.backend import PrefillLayout
from jvllm.worker.step_shapes import StepShape
from models.attention import AttentionMetadata


@dataclasses.dataclass
class ChunkRow:
    """What a step needs of one chunk: its input ids (0 where a look-ahead token comes from the device),
    the position of the first, and the sequence's page table."""

    token_ids: list[int]
    start: int
    page_table: list[int]
    mm_rows: list[int] | None = None  # multimodal: per token, its encoder-buffer row (-1: a text token)
    positions: np.ndarray | None = None  # [3, n] int32 M-RoPE positions when they differ from the token indices


@dataclasses.dataclass
class HostBatch:
    """Numpy inputs of one step of `shape`."""

    shape: StepShape
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32; [3, T] for M-RoPE models
    metadata: AttentionMetadata  # numpy leaves, moved to the device by the runner
    num_rows: int  # real sequence rows (the rest are padding)
    mm_rows: np.ndarray | None = None  # [T] int32 encoder-buffer row of each token (-1: text), multimodal models


def build_batch(rows: list[ChunkRow], shape: StepShape, page_size: int, max_pages: int,
                prefill_layout: PrefillLayout, multimodal: bool = False, mrope: bool = False) -> HostBatch:
    """Chunks back to back in T flat tokens; row s of the metadata is rows[s]. A decode shape needs every chunk
    to be one token (token s is row s). `multimodal` adds the tokens' encoder-buffer rows; `mrope` makes the
    positions [3, T] (a row without its own takes its token indices on all three)."""
    num_tokens, num_seqs = shape.tokens, shape.seqs
    total = sum(len(r.token_ids) for r in rows)
    if total > num_tokens or len(rows) > num_seqs:
        raise ValueError(f"{len(rows)} chunks of {total} tokens do not fit a {shape} step")
    lens = np.fromiter((len(r.token_ids) for r in rows), np.int32, len(rows))  # [n]
    starts = np.fromiter((r.start for r in rows), np.int32, len(rows))  # [n] position of each chunk's first token
    query_start = np.zeros(num_seqs, np.int32)
    q_lens = np.zeros(num_seqs, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    q_lens[: len(rows)] = lens
    kv_lens[: len(rows)] = starts + lens
    np.cumsum(lens[:-1], out=query_start[1 : len(rows)])
    page_tables = np.zeros((num_seqs, max_pages), np.int32)
    for index, row in enumerate(rows):
        page_tables[index, : len(row.page_table)] = row.page_table

    input_ids = np.zeros(num_tokens, np.int32)
    input_ids[:total] = [token_id for row in rows for token_id in row.token_ids]
    row_of_token = np.repeat(np.arange(len(rows)), lens)  # [total]
    pos = np.arange(total, dtype=np.int32) + (starts - query_start[: len(rows)])[row_of_token]  # [total]
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding writes into the reserved page 0
    slot_mapping[:total] = page_tables[row_of_token, pos // page_size] * page_size + pos % page_size
    positions = np.zeros((3, num_tokens) if mrope else num_tokens, np.int32)
    positions[..., :total] = pos
    mm_rows = np.full(num_tokens, -1, np.int32) if multimodal else None
    for index, row in enumerate(rows if multimodal or mrope else ()):  # images: M-RoPE positions, buffer rows
        span = slice(int(query_start[index]), int(query_start[index] + lens[index]))
        if row.positions is not None:
            positions[..., span] = row.positions
        if mm_rows is not None and row.mm_rows is not None:
            mm_rows[span] = row.mm_rows
    decode = shape.kind == "decode"
    if decode and total != len(rows):
        raise ValueError("a decode step takes one token per chunk")
    n = len(rows)
    layout = {} if decode else prefill_layout(q_lens[:n], query_start[:n], kv_lens[:n] - q_lens[:n], num_tokens,
                                              num_seqs)
    md = AttentionMetadata(slot_mapping, query_start, q_lens, kv_lens, page_tables, layout, decode)
    return HostBatch(shape, input_ids, positions, md, n, mm_rows)
