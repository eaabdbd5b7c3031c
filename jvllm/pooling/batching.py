"""Plans embedding batches (pure Python): pack sequences into rows of padded power-of-two [rows, width]
buckets. Several short sequences share a row (attention stays within each), so short inputs waste almost no
compute on padding and a handful of shapes cover any mix of lengths."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jvllm.utils import next_power_of_2, prev_power_of_2

MIN_WIDTH = 8
PACK_WIDTH = 64  # rows of many short inputs are this wide; attention per token grows with it, but stays
# ~1% of the layer matmuls at 64 (4 * W * D vs ~24 * D^2 multiply-adds per token for BERT shapes)


def width_for(n: int) -> int:
    """Row width that holds a sequence of n tokens: a power of two, at least MIN_WIDTH."""
    return max(next_power_of_2(n), MIN_WIDTH)


@dataclasses.dataclass(frozen=True)
class EmbedBatch:
    """One forward pass over `rows` x `width` token slots. `placements[k]` = (input index, row, column) of
    the batch's k-th sequence; k is also its output slot."""

    placements: tuple[tuple[int, int, int], ...]
    rows: int  # a power of two
    width: int  # a power of two

    @property
    def indices(self) -> list[int]:
        return [index for index, _, _ in self.placements]


def _pack_rows(items: list[tuple[int, int]], width: int, max_per_row: int) -> list[list[tuple[int, int]]]:
    """Best-fit decreasing of (index, length) items into rows of `width`, at most max_per_row per row.
    -> rows, each a list of (index, column); items sit contiguously from column 0."""
    rows: list[list[tuple[int, int]]] = []
    used: list[int] = []
    by_free: list[list[int]] = [[] for _ in range(width + 1)]  # free tokens -> rows with that much room
    for index, length in sorted(items, key=lambda item: (-item[1], item[0])):
        room = next((free for free in range(length, width + 1) if by_free[free]), None)
        if room is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        else:
            row = by_free[room].pop()
        rows[row].append((index, used[row]))
        used[row] += length
        if len(rows[row]) < max_per_row and used[row] < width:
            by_free[width - used[row]].append(row)
    return rows


def _row_groups(count: int, cap: int) -> list[int]:
    """Split `count` rows into batches of at most `cap` (a power of two) rows. A tail that would pad more
    than a quarter of its bucket (and more than one row) is split again: 23 rows -> 16 + 7 padded to 8."""
    groups = []
    while count > 0:
        take = min(count, cap)
        if take < cap and next_power_of_2(take) - take > max(1, take // 4):
            take = prev_power_of_2(take)
        groups.append(take)
        count -= take
    return groups


def plan_batches(lengths: Sequence[int], *, max_num_seqs: int, max_num_batched_tokens: int,
                 share_rows: bool = True) -> list[EmbedBatch]:
    """Cover every input exactly once in batches of at most max_num_seqs sequences and rows x width <=
    max_num_batched_tokens padded tokens (a single row may exceed a budget below its width).

    Inputs of up to PACK_WIDTH tokens share PACK_WIDTH-wide rows (packed best-fit, so rows are nearly full);
    longer ones get rows of their power-of-two width. With share_rows=False (models that cannot mask within a
    row) each sequence has a row of its own, grouped with others of the same width."""
    classes: dict[int, list[tuple[int, int]]] = {}
    for index, length in enumerate(lengths):
        width = max(width_for(length), PACK_WIDTH if share_rows else MIN_WIDTH)
        classes.setdefault(width, []).append((index, length))
    batches: list[EmbedBatch] = []
    for width in sorted(classes):
        items = classes[width]
        if share_rows:
            rows = _pack_rows(items, width, max_num_seqs)
        else:
            rows = [[(index, 0)] for index, _ in sorted(items, key=lambda item: (item[1], item[0]))]
        cap = min(max(prev_power_of_2(max_num_batched_tokens // width), 1), prev_power_of_2(max_num_seqs))
        start = 0
        for take in _row_groups(len(rows), cap):
            group = rows[start: start + take]
            start += take
            batches.extend(_split_by_seqs(group, width, max_num_seqs, lengths))
    return batches


def _split_by_seqs(rows: list[list[tuple[int, int]]], width: int, max_num_seqs: int,
                   lengths: Sequence[int]) -> list[EmbedBatch]:
    """Batches of these rows holding at most max_num_seqs sequences each; a lone row narrows to the power of
    two its tokens need (one short query runs as [1, 8], not [1, 64])."""
    batches, current, count = [], [], 0
    for row in rows:
        if current and count + len(row) > max_num_seqs:
            batches.append(_batch(current, width, lengths))
            current, count = [], 0
        current.append(row)
        count += len(row)
    if current:
        batches.append(_batch(current, width, lengths))
    return batches


def _batch(rows: list[list[tuple[int, int]]], width: int, lengths: Sequence[int]) -> EmbedBatch:
    placements = tuple((index, r, column) for r, row in enumerate(rows) for index, column in row)
    if len(rows) == 1:
        width = min(width, width_for(sum(lengths[index] for index, _ in rows[0])))
    return EmbedBatch(placements, next_power_of_2(len(rows)), width)


def batch_shapes(max_model_len: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                 share_rows: bool = True) -> list[tuple[int, int]]:
    """Every (rows, width) `plan_batches` can produce for these limits: a lone row of any width, and for each
    width a class of inputs lands in, a power of two of rows up to what the budget allows."""
    widths, width = [], MIN_WIDTH
    while width < width_for(max_model_len):
        widths.append(width)
        width *= 2
    widths.append(width)
    shapes = {(1, w) for w in widths}
    for w in widths:
        if share_rows and w < PACK_WIDTH:
            continue  # short inputs share PACK_WIDTH-wide rows
        cap = min(max(prev_power_of_2(max_num_batched_tokens // w), 1), prev_power_of_2(max_num_seqs))
        shapes.update((rows, w) for rows in (1 << i for i in range(cap.bit_length())) if rows <= cap)
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def pack_arrays(token_lists: Sequence[Sequence[int]], batch: EmbedBatch, pad_id: int = 0,
                token_types: Sequence[Sequence[int]] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """-> input_ids, positions, segments, types [rows, width] int32. segments is 1 + the output slot of the sequence
    owning each token (0 = padding): tokens attend within their segment and pool into their slot. types holds each
    token's type id (a pair's second text is 1 for BERT) from `token_types`, else 0."""
    shape = (batch.rows, batch.width)
    ids, positions, segments = np.full(shape, pad_id, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    types = np.zeros(shape, np.int32)
    for slot, (index, row, column) in enumerate(batch.placements):
        tokens = token_lists[index]
        span = slice(column, column + len(tokens))
        ids[row, span] = tokens
        positions[row, span] = np.arange(len(tokens))
        segments[row, span] = slot + 1
        if token_types is not None:
            types[row, span] = token_types[index]
    return ids, positions, segments, types
