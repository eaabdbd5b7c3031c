"""Packs scheduled chunks into padded, bucketed host arrays for one jitted model step."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from models.attention import AttentionMetadata
from jvllm.core.scheduler import ScheduledChunk
from jvllm.utils import cdiv, next_power_of_2


LINEAR_BUCKETS_FROM = 256  # above this, buckets grow in steps of 256: a 1030-token chunk pads to 1280, not 2048
# Decode-only steps pad their page tables to cover at least this many tokens, so one decode shape serves every
# sequence's first 128 tokens: a 6-token prompt + 30 tokens used to need 3 (1, 2 and 4 pages), each traced and
# compiled, or loaded from the cache, on its own (~1.5 s each on a second start). Both backends' decode
# attention skips pages past the longest context, so the padding costs no attention work.
DECODE_MIN_CONTEXT_TOKENS = 128


def next_bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n up to 256, then the next multiple of 256; never above `cap` (cap >= n). 0 stays
    0: a step of first prefill chunks on the xla backend has no cached pages to gather, not 1 padded page
    (2048-token prefill step 1062 -> 1028 ms, same process, interleaved, median of 15)."""
    if n == 0:
        return 0
    if n > LINEAR_BUCKETS_FROM:
        bucket = cdiv(n, LINEAR_BUCKETS_FROM) * LINEAR_BUCKETS_FROM
    else:
        bucket = next_power_of_2(n)
    return max(n, min(bucket, cap))


@dataclasses.dataclass(frozen=True)
class BucketLimits:
    max_tokens: int  # max_num_batched_tokens
    max_seqs: int  # max_num_seqs
    max_pages: int  # pages of one max_model_len sequence
    min_rows: int = 1  # token and sequence buckets at least this big (up to the caps)


@dataclasses.dataclass
class HostBatch:
    """Numpy inputs of one step; `shape_key` names the compiled variant it needs."""

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    metadata: AttentionMetadata  # numpy leaves, moved to device by the runner
    num_seqs: int  # real rows (the rest are padding)

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        md = self.metadata
        return (self.input_ids.shape[0], *md.seq_token_index.shape, md.page_tables.shape[1])


@dataclasses.dataclass
class ChunkRow:
    """What a step needs of one chunk: its input ids (0 where a look-ahead token comes from the device),
    the position of the first, and the sequence's page table."""

    token_ids: list[int]
    start: int
    page_table: list[int]


def chunk_rows(chunks: list[ScheduledChunk]) -> list[ChunkRow]:
    rows = []
    for chunk in chunks:
        request, start = chunk.request, chunk.start
        ids = [request.token_at(i) for i in range(start, start + chunk.num_tokens - chunk.pending_tokens)]
        rows.append(ChunkRow(ids + [0] * chunk.pending_tokens, start, request.page_table))
    return rows


TablePages = Callable[[int, int, int], int]  # (cached tokens, step tokens, page size) -> pages the table lists


def build_batch(rows: list[ChunkRow], page_size: int, limits: BucketLimits, table_pages: TablePages) -> HostBatch:
    """Pack chunk rows into bucketed arrays; each page table lists the pages `table_pages` says the attention
    backend reads (a backend that attends to the step's own K/V directly needs only the cached ones)."""
    total = sum(len(r.token_ids) for r in rows)
    num_tokens = max(next_bucket(total, limits.max_tokens), min(limits.min_rows, limits.max_tokens))
    num_seqs = max(next_bucket(len(rows), limits.max_seqs), min(limits.min_rows, limits.max_seqs))
    max_q = next_bucket(max(len(r.token_ids) for r in rows), limits.max_tokens)
    table_len = [table_pages(r.start, len(r.token_ids), page_size) for r in rows]
    max_pages = next_bucket(max(table_len), limits.max_pages)
    if max_q == 1:
        max_pages = max(max_pages, min(cdiv(DECODE_MIN_CONTEXT_TOKENS, page_size), limits.max_pages))

    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding writes into the reserved page 0
    token_seq = np.zeros(num_tokens, np.int32)
    token_offset = np.zeros(num_tokens, np.int32)
    seq_token_index = np.zeros((num_seqs, max_q), np.int32)
    query_start = np.zeros(num_seqs, np.int32)
    q_lens = np.zeros(num_seqs, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_tables = np.zeros((num_seqs, max_pages), np.int32)

    cursor = 0
    for index, row in enumerate(rows):
        n, start = len(row.token_ids), row.start
        span = slice(cursor, cursor + n)
        pos = np.arange(start, start + n, dtype=np.int32)
        input_ids[span] = row.token_ids
        positions[span] = pos
        pages = np.asarray(row.page_table, np.int32)
        slot_mapping[span] = pages[pos // page_size] * page_size + pos % page_size
        token_seq[span] = index
        token_offset[span] = np.arange(n)
        seq_token_index[index, :n] = np.arange(cursor, cursor + n)
        query_start[index] = cursor
        q_lens[index] = n
        kv_lens[index] = start + n
        page_tables[index, : table_len[index]] = pages[: table_len[index]]
        cursor += n
    md = AttentionMetadata(slot_mapping, token_seq, token_offset, seq_token_index, query_start, q_lens, kv_lens,
                           page_tables)
    return HostBatch(input_ids, positions, md, len(rows))
