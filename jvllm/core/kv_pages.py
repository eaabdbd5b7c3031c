"""Host-side KV page manager: one fixed pool, reference counts, and the prefix cache's page keys (pure Python).

Free pages live in one LRU list. A page without a key is reused first; a freed page that holds a cached
prefix keeps its key and joins the back, so the least recently used cached page is evicted first (and loses
its key) when the pool runs short. The pages of one allocation are handed out in ascending order, so a prompt's
pages lie in address order in the pool, which its attention reads faster than pages in release order
(docs/design/host_loop.md, "KV pages in address order").

Partial last pages ("tails") are cached too: a request that leaves keeps its last, partly filled page findable by
the key of the full pages before it (and its cache salt) and the token ids it holds. A later request whose tokens
continue those full pages with some of the same ids (a beam search's next round, a preempted request coming back)
starts from a copy of that page instead of recomputing its tokens: the copy, because the tail is shared and the
new request writes past its common part."""
from __future__ import annotations

from collections import OrderedDict

from jvllm.utils import cdiv


class OutOfPages(Exception):
    """Raised when an allocation needs more free pages than the pool has."""


class PageManager:
    """Hands out page ids of the device pool. Page 0 is reserved: padding tokens write there."""

    RESERVED_PAGE = 0
    # the newest tails kept per owner: enough for a wide beam search's last round, while a prefix that thousands
    # of requests share (a system prompt) does not make each lookup scan thousands of tails
    MAX_TAILS_PER_OWNER = 64

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: OrderedDict[int, None] = OrderedDict((page, None) for page in range(1, num_pages))
        self._refcount = [0] * num_pages
        self._key_of_page: dict[int, int] = {}
        self._page_of_key: dict[int, int] = {}
        self._tails: dict[tuple[int, bytes], dict[int, tuple[int, ...]]] = {}  # owner -> {page: its token ids}
        self._owner_of_tail: dict[int, tuple[int, bytes]] = {}  # page -> owner (parent key, cache salt)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages nobody holds, cached ones included (they are reusable)."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_of_key)

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use (0.0 .. 1.0)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def allocate(self, count: int) -> list[int]:
        """Fresh pages for new tokens, in ascending order, evicting the least recently used cached pages if
        needed."""
        if count > len(self._free):
            raise OutOfPages(f"need {count} pages, {len(self._free)} free")
        pages = sorted(self._free.popitem(last=False)[0] for _ in range(count))
        for page in pages:
            self._forget(page)
            self._refcount[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another owner holds these pages too (e.g. n > 1 completions of one prompt)."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise RuntimeError(f"sharing free page {page}")
            self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; pages nobody holds go back to the free list (keyed ones to its back).
        A request's pages are released last-first, so its tail is evicted before the prefix others share."""
        for page in reversed(pages):
            if self._refcount[page] <= 0:
                raise RuntimeError(f"double free of page {page}")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free[page] = None
                if page not in self._key_of_page and page not in self._owner_of_tail:
                    self._free.move_to_end(page, last=False)  # nothing worth keeping: reuse it first

    # ---- prefix cache ----------------------------------------------------------------------------
    def register(self, page: int, key: int) -> None:
        """A held, full, computed page now answers to `key`. If another page already does, keep that one."""
        if self._refcount[page] <= 0:
            raise RuntimeError(f"registering free page {page}")
        if key not in self._page_of_key and page not in self._key_of_page:
            self._page_of_key[key] = page
            self._key_of_page[page] = key

    def lookup(self, keys: list[int]) -> list[int]:
        """Take a reference on the cached pages of the longest prefix of `keys` -> their page ids."""
        found = []
        for key in keys:
            page = self._page_of_key.get(key)
            if page is None:
                break
            self.hold(page)
            found.append(page)
        return found

    def hold(self, page: int) -> None:
        """Take a reference on a page, held or cached."""
        if self._refcount[page] == 0:
            del self._free[page]
        self._refcount[page] += 1

    def register_tail(self, page: int, owner: tuple[int, bytes], token_ids: tuple[int, ...]) -> None:
        """A held page holds the computed KV of `token_ids` (1 to page_size - 1 tokens) after the full pages whose
        last key (0: none) and cache salt are `owner`: findable by tail_match until evicted."""
        if self._refcount[page] <= 0:
            raise RuntimeError(f"registering free page {page}")
        if page in self._key_of_page or page in self._owner_of_tail or not 0 < len(token_ids) < self.page_size:
            return
        if len(self._tails.get(owner, ())) >= self.MAX_TAILS_PER_OWNER:
            self._forget(next(iter(self._tails[owner])))  # the oldest; the page stays where it is in the free list
        self._tails.setdefault(owner, {})[page] = token_ids
        self._owner_of_tail[page] = owner

    def tail_match(self, owner: tuple[int, bytes], token_ids: list[int]) -> tuple[int, int] | None:
        """The cached tail of `owner` that shares the longest prefix with `token_ids` -> (its page, how many
        leading ids they share), None if none shares one. The page is not held: hold it while allocating the page
        to copy it into."""
        best, best_length = None, 0
        for page, cached in self._tails.get(owner, {}).items():
            length = 0
            for mine, theirs in zip(token_ids, cached):
                if mine != theirs:
                    break
                length += 1
            if length > best_length:
                best, best_length = page, length
        return None if best is None else (best, best_length)

    @property
    def num_cached_tails(self) -> int:
        return len(self._owner_of_tail)

    def reset_prefix_cache(self) -> None:
        """Forget every cached key; pages in use stay allocated, they just stop being findable."""
        self._key_of_page.clear()
        self._page_of_key.clear()
        self._tails.clear()
        self._owner_of_tail.clear()

    def _forget(self, page: int) -> None:
        key = self._key_of_page.pop(page, None)
        if key is not None:
            del self._page_of_key[key]
        owner = self._owner_of_tail.pop(page, None)
        if owner is not None:
            tails = self._tails[owner]
            del tails[page]
            if not tails:
                del self._tails[owner]

    def check_integrity(self) -> None:
        """Every page is either free with refcount 0 or held with refcount > 0; the key maps are inverse."""
        free = set(self._free)
        assert self.RESERVED_PAGE not in free, "the reserved page is on the free list"
        for page in range(1, self.num_pages):
            assert (page in free) == (self._refcount[page] == 0), f"page {page} refcount {self._refcount[page]}"
        assert all(self._page_of_key[key] == page for page, key in self._key_of_page.items()), "key maps disagree"
        assert len(self._key_of_page) == len(self._page_of_key), "key maps differ in size"
        assert not set(self._key_of_page) & set(self._owner_of_tail), "a page is both a full page and a tail"
        assert all(page in self._tails[owner] for page, owner in self._owner_of_tail.items()), "tail maps disagree"
        assert sum(map(len, self._tails.values())) == len(self._owner_of_tail), "tail maps differ in size"
