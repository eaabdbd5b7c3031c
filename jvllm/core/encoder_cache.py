"""Multimodal items of a request and the host-side map of the device's encoder-output buffer (pure Python).

The buffer ([rows, hidden] on the device, jvllm.worker.encoder_runner) is cut into blocks of `block_rows` rows,
like the KV pool into pages; block 0 is reserved (padded encoder rows are written there). Each encoded item
(keyed by its content hash) holds enough blocks for its rows. An item is pinned while a running request still
has placeholder tokens of it to compute; unpinned items stay cached, least recently used evicted first."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from jvllm.utils import cdiv


ENCODER_BLOCK_ROWS = 16  # the buffer's allocation unit


def encoder_cache_rows(max_image_tokens: int, max_num_batched_tokens: int, requested: int | None) -> int:
    """The buffer's rows: `requested` (the engine's `encoder_cache_tokens`), by default room for a whole step's
    worth of image tokens twice over and at least 8 of the largest images; always at least one largest image, plus
    the reserved block."""
    rows = requested if requested is not None else max(2 * max_num_batched_tokens, 8 * max_image_tokens)
    if rows < max_image_tokens:
        raise ValueError(f"encoder_cache_tokens={rows} cannot hold one image ({max_image_tokens} tokens)")
    return (cdiv(rows, ENCODER_BLOCK_ROWS) + 1) * ENCODER_BLOCK_ROWS


@dataclasses.dataclass(eq=False)
class MultiModalItem:
    """One image of a prompt: the placeholder tokens it fills and what the encoder takes (vLLM's mm_hashes and
    mm_positions, per item). Other families may give items different lengths; nothing here assumes one."""

    modality: str  # "image"
    hash: int  # 64-bit content hash of the encoder input (its bytes and shape)
    offset: int  # first placeholder token in the prompt
    length: int  # placeholder tokens, which is also the encoder's output rows for it
    data: Any  # the encoder's input (numpy pixel values, or flattened patches); opaque here
    grid: tuple[int, int] | None = None  # its tokens' (rows, columns) in the image, for M-RoPE models (Qwen2-VL)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclasses.dataclass
class _Entry:
    blocks: list[int]
    length: int
    pinned_by: set[str] = dataclasses.field(default_factory=set)  # request ids
    ready: bool = False  # its encode step has been dispatched


@dataclasses.dataclass
class EncoderBudget:
    """One step's encoder work: the items to encode before the step runs, within `tokens_left` output rows."""

    tokens_left: int
    to_encode: dict[int, tuple[str, MultiModalItem]] = dataclasses.field(default_factory=dict)  # hash -> (owner, item)

    def items_of(self, request_id: str) -> list[MultiModalItem]:
        return [item for owner, item in self.to_encode.values() if owner == request_id]

    def drop(self, request_id: str) -> None:
        """Forget what `request_id` asked to encode (its chunk was not scheduled after all)."""
        for key in [k for k, (owner, _) in self.to_encode.items() if owner == request_id]:
            self.tokens_left += self.to_encode.pop(key)[1].length


class EncoderCache:
    """Which rows of the device buffer hold which item's encoder output."""

    RESERVED_BLOCK = 0

    def __init__(self, num_rows: int, block_rows: int):
        if num_rows < 2 * block_rows:
            raise ValueError(f"the encoder cache needs at least {2 * block_rows} rows, got {num_rows}")
        self.block_rows = block_rows
        self.num_blocks = num_rows // block_rows
        self._free = list(range(self.num_blocks - 1, 0, -1))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self.queries = 0  # items looked up by scheduled chunks
        self.hits = 0  # of those, found with their encoder output already computed

    @property
    def num_rows(self) -> int:
        return self.num_blocks * self.block_rows

    @property
    def capacity(self) -> int:
        """Rows an item may use (the reserved block excluded)."""
        return (self.num_blocks - 1) * self.block_rows

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def is_ready(self, key: int) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    # ---- scheduling ----------------------------------------------------------------------------------
    def schedule(self, request: Any, start: int, count: int, budget: EncoderBudget) -> int:
        """Tokens [start, start + count) of `request` may run once every item they touch has its rows: cached
        items are pinned, the others get rows and join `budget` (encoded before the step). -> how many of the
        tokens can run: the chunk stops before the first item the budget or the free rows cannot take."""
        for item in request.mm_items:
            if item.end <= start:
                continue
            if item.offset >= start + count:
                break
            entry = self._entries.get(item.hash)
            encode = entry is None or (not entry.ready and item.hash not in budget.to_encode)
            if encode and item.length > budget.tokens_left or entry is None and not self._allocate(item):
                return max(item.offset - start, 0)
            entry = self._entries[item.hash]
            self._entries.move_to_end(item.hash)
            if request.request_id not in entry.pinned_by:
                self.queries += 1
                self.hits += entry.ready
                entry.pinned_by.add(request.request_id)
            if encode:
                budget.to_encode[item.hash] = (request.request_id, item)
                budget.tokens_left -= item.length
        return count

    def _allocate(self, item: MultiModalItem) -> bool:
        """Rows for a new item, evicting unpinned items least recently used first; False (nothing changed) when
        even that leaves too few."""
        needed = cdiv(item.length, self.block_rows)
        evictable = [key for key, entry in self._entries.items() if not entry.pinned_by]
        if needed > len(self._free) + sum(len(self._entries[key].blocks) for key in evictable):
            return False
        for key in evictable:
            if len(self._free) >= needed:
                break
            self._free.extend(self._entries.pop(key).blocks)
        self._entries[item.hash] = _Entry([self._free.pop() for _ in range(needed)], item.length)
        return True

    def mark_ready(self, items: list[MultiModalItem]) -> None:
        """Their encode step is dispatched: steps after it read their rows."""
        for item in items:
            entry = self._entries.get(item.hash)
            if entry is not None:
                entry.ready = True

    def release_passed(self, request: Any) -> None:
        """Unpin the items whose placeholder tokens `request` has all computed."""
        still_needed = {item.hash for item in request.mm_items if item.end > request.num_computed_tokens}
        for item in request.mm_items:
            if item.hash not in still_needed:  # the same image may fill several spans
                self._unpin(item.hash, request.request_id)

    def release(self, request: Any) -> None:
        """Unpin every item of `request` (finished, preempted, or its chunk dropped)."""
        for item in request.mm_items:
            self._unpin(item.hash, request.request_id)

    def _unpin(self, key: int, request_id: str) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.pinned_by.discard(request_id)

    def reset(self) -> None:
        """Forget every unpinned item (pinned ones stay: running requests read them)."""
        for key in [key for key, entry in self._entries.items() if not entry.pinned_by]:
            self._free.extend(self._entries.pop(key).blocks)

    # ---- rows --------------------------------------------------------------------------------------
    def item_rows(self, key: int) -> list[int]:
        """The buffer rows of an item's output, in order."""
        entry = self._entries[key]
        b = self.block_rows
        return [entry.blocks[i // b] * b + i % b for i in range(entry.length)]

    def token_rows(self, request: Any, start: int, count: int) -> list[int]:
        """Per token of [start, start + count): the buffer row its embedding comes from, -1 for a text token."""
        rows = [-1] * count
        for item in request.mm_items:
            lo, hi = max(item.offset, start), min(item.end, start + count)
            if lo < hi:
                item_rows = self.item_rows(item.hash)
                rows[lo - start:hi - start] = item_rows[lo - item.offset:hi - item.offset]
        return rows

    def check_integrity(self) -> None:
        """Every block but the reserved one is free or held by exactly one item."""
        held = [block for entry in self._entries.values() for block in entry.blocks]
        assert len(held) == len(set(held)), "a block is held twice"
        assert not set(held) & set(self._free), "a held block is on the free list"
        assert sorted(held + self._free) == list(range(1, self.num_blocks)), "blocks are missing"

    @property
    def num_pinned(self) -> int:
        return sum(bool(entry.pinned_by) for entry in self._entries.values())
