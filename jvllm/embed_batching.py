"""Plans embedding batches (pure Python): sort by length, pack sequences into rows of a padded power-of-two
[rows, width] bucket. Several short sequences share a row (attention stays within each), so short inputs
waste almost no compute on padding and a handful of shapes cover any mix of lengths."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

MIN_WIDTH = 8
PACK_WIDTH = 64  # rows of many short inputs are this wide; attention per token grows with it, but stays
# ~1% of the layer matmuls at 64 (4 * W * D vs ~24 * D^2 multiply-adds per token for BERT shapes)


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def width_for(n: int) -> int:
    """Row width that holds a sequence of n tokens: a power of two, at least MIN_WIDTH."""
    return max(pow2_at_least(n), MIN_WIDTH)


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


def _pack(items: Sequence[tuple[int, int]], width: int, share_rows: bool) -> list[tuple[int, int, int]] | None:
    """First-fit decreasing of (index, length) items into rows of `width`; -> placements (in the items'
    order) or None when an item is wider than a row."""
    rows = _Rows(width, share_rows)
    where = {}
    for index, length in sorted(items, key=lambda item: -item[1]):
        if length > width:
            return None
        where[index] = rows.place(length)
    return [(index, *where[index]) for index, _ in items]


class _Rows:
    """Incremental first-fit of sequences into rows of one width (which may grow); without `share_rows`
    every sequence gets a row of its own."""

    def __init__(self, width: int, share_rows: bool):
        self.width, self.share_rows, self.free = width, share_rows, []  # free tokens left in each row

    def widen(self, width: int) -> None:
        self.free = [room + width - self.width for room in self.free]
        self.width = width

    def first_fit(self, length: int) -> int:
        """The row a sequence of `length` would go to (len(free) = a new row)."""
        if not self.share_rows:
            return len(self.free)
        return next((r for r, room in enumerate(self.free) if room >= length), len(self.free))

    def rows_after(self, length: int, width: int) -> int:
        """How many rows there would be after widening to `width` and placing a sequence of `length`."""
        grow = width - self.width
        row = next((r for r, room in enumerate(self.free) if room + grow >= length and self.share_rows),
                   len(self.free))
        return max(len(self.free), row + 1)

    def place(self, length: int) -> tuple[int, int]:
        row = self.first_fit(length)
        if row == len(self.free):
            self.free.append(self.width)
        column = self.width - self.free[row]
        self.free[row] -= length
        return row, column


def _bucket(placements: list[tuple[int, int, int]], width: int) -> EmbedBatch:
    return EmbedBatch(tuple(placements), pow2_at_least(1 + max(r for _, r, _ in placements)), width)


def _narrowest(batch: EmbedBatch, lengths: Sequence[int], share_rows: bool) -> EmbedBatch:
    """Repack at half the width while that shrinks rows x width (e.g. one short query: [1, 8], not [1, 64])."""
    items = [(index, lengths[index]) for index in batch.indices]
    while batch.width // 2 >= MIN_WIDTH:
        narrower = _pack(items, batch.width // 2, share_rows)
        if narrower is None:
            break
        candidate = _bucket(narrower, batch.width // 2)
        if candidate.rows * candidate.width >= batch.rows * batch.width:
            break
        batch = candidate
    return batch


def plan_batches(lengths: Sequence[int], *, max_num_seqs: int, max_num_batched_tokens: int,
                 share_rows: bool = True) -> list[EmbedBatch]:
    """Cover every input exactly once, shortest first. A batch holds at most max_num_seqs sequences and
    rows x width <= max_num_batched_tokens padded tokens, unless it is a single row (a budget below one row's
    width still runs one row at a time). With
    share_rows=False (models that cannot mask within a row) each sequence has its own row."""
    base_width = PACK_WIDTH if share_rows and max_num_batched_tokens >= PACK_WIDTH else MIN_WIDTH
    batches: list[EmbedBatch] = []
    placements: list[tuple[int, int, int]] = []
    rows = _Rows(base_width, share_rows)

    def max_rows(width: int) -> int:
        return max(pow2_at_most(max_num_batched_tokens // width), 1)

    for index in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        length = lengths[index]
        width = max(rows.width, width_for(length))
        if placements and (len(placements) >= max_num_seqs or rows.rows_after(length, width) > max_rows(width)):
            batches.append(_narrowest(_bucket(placements, rows.width), lengths, share_rows))
            placements, rows = [], _Rows(max(base_width, width_for(length)), share_rows)
            width = rows.width
        if width > rows.width:
            rows.widen(width)
        placements.append((index, *rows.place(length)))
    if placements:
        batches.append(_narrowest(_bucket(placements, rows.width), lengths, share_rows))
    return batches


def pack_arrays(token_lists: Sequence[Sequence[int]], batch: EmbedBatch, pad_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> input_ids, positions, segments [rows, width] int32. segments is 1 + the output slot of the sequence
    owning each token (0 = padding): tokens attend within their segment and pool into their slot."""
    shape = (batch.rows, batch.width)
    ids, positions, segments = np.full(shape, pad_id, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    for slot, (index, row, column) in enumerate(batch.placements):
        tokens = token_lists[index]
        span = slice(column, column + len(tokens))
        ids[row, span] = tokens
        positions[row, span] = np.arange(len(tokens))
        segments[row, span] = slot + 1
    return ids, positions, segments
