"""Packs scheduled chunks into padded, bucketed host arrays for one jitted model step."""
from __future__ import annotations

import dataclasses

import numpy as np

from jvllm.attention.metadata import AttentionMetadata
from jvllm.scheduler import ScheduledChunk


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
        bucket = -(-n // LINEAR_BUCKETS_FROM) * LINEAR_BUCKETS_FROM
    else:
        bucket = 1 << (n - 1).bit_length()
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
        return (self.input_ids.shape[0], *md.seq_token_index.shape, md.block_tables.shape[1])


def build_batch(chunks: list[ScheduledChunk], page_size: int, limits: BucketLimits, *,
                cached_pages_only: bool = False) -> HostBatch:
    """With `cached_pages_only` the block tables cover only tokens cached before this step (enough for a
    backend that attends to the step's own K/V directly): a first prefill chunk then gathers no context."""
    total = sum(c.num_tokens for c in chunks)
    num_tokens = max(next_bucket(total, limits.max_tokens), min(limits.min_rows, limits.max_tokens))
    num_seqs = max(next_bucket(len(chunks), limits.max_seqs), min(limits.min_rows, limits.max_seqs))
    max_q = next_bucket(max(c.num_tokens for c in chunks), limits.max_tokens)
    table_len = [-(-c.start // page_size) if cached_pages_only else len(c.request.page_table) for c in chunks]
    max_pages = next_bucket(max(table_len), limits.max_pages)
    if max_q == 1:
        max_pages = max(max_pages, min(-(-DECODE_MIN_CONTEXT_TOKENS // page_size), limits.max_pages))

    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding writes into the reserved page 0
    token_seq = np.zeros(num_tokens, np.int32)
    token_offset = np.zeros(num_tokens, np.int32)
    seq_token_index = np.zeros((num_seqs, max_q), np.int32)
    query_start = np.zeros(num_seqs, np.int32)
    q_lens = np.zeros(num_seqs, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    block_tables = np.zeros((num_seqs, max_pages), np.int32)

    cursor = 0
    for row, chunk in enumerate(chunks):
        request, n, start = chunk.request, chunk.num_tokens, chunk.start
        span = slice(cursor, cursor + n)
        pos = np.arange(start, start + n, dtype=np.int32)
        input_ids[span] = [request.token_at(i) for i in range(start, start + n - chunk.pending_tokens)] + \
            [0] * chunk.pending_tokens  # the runner fills a look-ahead token from the device
        positions[span] = pos
        pages = np.asarray(request.page_table, np.int32)
        slot_mapping[span] = pages[pos // page_size] * page_size + pos % page_size
        token_seq[span] = row
        token_offset[span] = np.arange(n)
        seq_token_index[row, :n] = np.arange(cursor, cursor + n)
        query_start[row] = cursor
        q_lens[row] = n
        kv_lens[row] = start + n
        block_tables[row, : table_len[row]] = pages[: table_len[row]]
        cursor += n
    md = AttentionMetadata(slot_mapping, token_seq, token_offset, seq_token_index, query_start, q_lens, kv_lens,
                           block_tables)
    return HostBatch(input_ids, positions, md, len(chunks))
