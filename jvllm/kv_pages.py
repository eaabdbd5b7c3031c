"""Host-side KV page manager: one fixed pool, a free list and reference counts (pure Python)."""
from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    """Raised when an allocation needs more free pages than the pool has."""


class PageManager:
    """Hands out page ids of the device pool. Page 0 is reserved: padding tokens write there."""

    RESERVED_PAGE = 0

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use (0.0 .. 1.0)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"need {count} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another owner holds these pages too (e.g. n > 1 completions of one prompt)."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise RuntimeError(f"sharing free page {page}")
            self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; pages nobody holds go back to the free list."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise RuntimeError(f"double free of page {page}")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)

    def check_integrity(self) -> None:
        """Every page is either free with refcount 0 or held with refcount > 0, never both."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert self.RESERVED_PAGE not in free, "the reserved page is on the free list"
        for page in range(1, self.num_pages):
            assert (page in free) == (self._refcount[page] == 0), f"page {page} refcount {self._refcount[page]}"
