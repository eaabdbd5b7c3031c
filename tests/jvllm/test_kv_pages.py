"""PageManager: allocation, reference counts, the reserved page and integrity (pure Python)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jvllm.core.kv_pages import OutOfPages, PageManager


def test_fresh_pool_has_every_page_but_the_reserved_one_free():
    pm = PageManager(8, 16)
    assert pm.num_pages == 8
    assert pm.num_usable_pages == 7
    assert pm.num_free_pages == 7
    assert pm.usage == 0.0
    pm.check_integrity()


@pytest.mark.parametrize("num_pages", [0, 1, -3])
def test_pool_needs_at_least_two_pages(num_pages):
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageManager(num_pages, 16)


@pytest.mark.parametrize("tokens,pages", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_pages_for_tokens_rounds_up(tokens, pages):
    assert PageManager(4, 16).pages_for_tokens(tokens) == pages


def test_allocate_gives_distinct_pages_and_release_returns_them():
    pm = PageManager(8, 16)
    a = pm.allocate(3)
    b = pm.allocate(2)
    assert len(a) == 3 and len(b) == 2
    assert len(set(a) | set(b)) == 5
    assert PageManager.RESERVED_PAGE not in a + b
    assert pm.num_free_pages == 2
    assert pm.usage == pytest.approx(5 / 7)
    pm.check_integrity()
    pm.release(a)
    assert pm.num_free_pages == 5
    pm.release(b)
    assert pm.num_free_pages == 7
    assert pm.usage == 0.0
    pm.check_integrity()


def test_allocate_zero_is_a_no_op():
    pm = PageManager(4, 16)
    assert pm.allocate(0) == []
    assert pm.num_free_pages == 3


def test_whole_pool_can_be_allocated_but_never_the_reserved_page():
    pm = PageManager(5, 16)
    pages = pm.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert pm.num_free_pages == 0
    assert pm.usage == 1.0
    with pytest.raises(OutOfPages):
        pm.allocate(1)
    pm.check_integrity()


def test_out_of_pages_allocates_nothing():
    pm = PageManager(4, 16)
    held = pm.allocate(2)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free"):
        pm.allocate(2)
    assert pm.num_free_pages == 1  # the failed call did not take the last page
    pm.check_integrity()
    pm.release(held)
    assert pm.num_free_pages == 3


def test_reserved_page_never_handed_out_across_many_cycles():
    pm = PageManager(3, 16)
    for _ in range(50):
        pages = pm.allocate(2)
        assert PageManager.RESERVED_PAGE not in pages
        pm.release(pages[::-1])
    pm.check_integrity()


def test_share_needs_every_owner_to_release():
    pm = PageManager(6, 16)
    pages = pm.allocate(2)
    pm.share(pages)
    pm.share(pages[:1])  # three owners of the first page, two of the second
    pm.release(pages)
    assert pm.num_free_pages == 3  # still held
    pm.check_integrity()
    pm.release(pages)
    assert pm.num_free_pages == 4  # second page freed, first still has one owner
    pm.check_integrity()
    pm.release(pages[:1])
    assert pm.num_free_pages == 5
    pm.check_integrity()


def test_double_free_raises():
    pm = PageManager(4, 16)
    pages = pm.allocate(1)
    pm.release(pages)
    with pytest.raises(RuntimeError, match="double free"):
        pm.release(pages)
    pm.check_integrity()
    assert pm.num_free_pages == 3


def test_releasing_a_never_allocated_page_raises():
    pm = PageManager(4, 16)
    with pytest.raises(RuntimeError, match="double free"):
        pm.release([2])
    with pytest.raises(RuntimeError, match="double free"):
        pm.release([PageManager.RESERVED_PAGE])
    pm.check_integrity()


def test_sharing_a_free_page_raises():
    pm = PageManager(4, 16)
    with pytest.raises(RuntimeError, match="sharing free page"):
        pm.share([1])
    pages = pm.allocate(1)
    pm.release(pages)
    with pytest.raises(RuntimeError, match="sharing free page"):
        pm.share(pages)
    pm.check_integrity()


def test_check_integrity_detects_corruption():
    pm = PageManager(4, 16)
    pages = pm.allocate(1)
    pm._refcount[pages[0]] = 0  # held page with no owner
    with pytest.raises(AssertionError):
        pm.check_integrity()
    pm = PageManager(4, 16)
    pm._free[PageManager.RESERVED_PAGE] = None
    with pytest.raises(AssertionError, match="reserved"):
        pm.check_integrity()
    pm = PageManager(4, 16)
    page = pm.allocate(1)[0]
    pm.register(page, 123)
    pm._page_of_key[123] = page + 1  # the two key maps disagree
    with pytest.raises(AssertionError, match="key maps"):
        pm.check_integrity()


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("share"), st.integers(0, 1000)),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 12), ops=_ops)
def test_integrity_after_random_operations(num_pages, ops):
    """A model of the owners (one list of pages per owner) matches the manager after each operation."""
    pm = PageManager(num_pages, 4)
    owners: list[list[int]] = []
    for op, arg in ops:
        if op == "alloc":
            if arg > pm.num_free_pages:
                with pytest.raises(OutOfPages):
                    pm.allocate(arg)
            else:
                pages = pm.allocate(arg)
                assert len(set(pages)) == arg
                assert PageManager.RESERVED_PAGE not in pages
                held = {p for o in owners for p in o}
                assert not held & set(pages), "a held page was handed out again"
                owners.append(pages)
        elif op == "share" and owners:
            source = owners[arg % len(owners)]
            pm.share(source)
            owners.append(list(source))
        elif op == "release" and owners:
            pm.release(owners.pop(arg % len(owners)))
        pm.check_integrity()
        refs: dict[int, int] = {}
        for o in owners:
            for p in o:
                refs[p] = refs.get(p, 0) + 1
        for page in range(1, num_pages):
            assert pm._refcount[page] == refs.get(page, 0)
        assert pm.num_free_pages == pm.num_usable_pages - len(refs)
        assert 0.0 <= pm.usage <= 1.0
    for o in owners:
        pm.release(o)
    pm.check_integrity()
    assert pm.num_free_pages == pm.num_usable_pages



def test_an_allocation_comes_in_address_order_after_pages_return_scrambled():
    pm = PageManager(12, 16)
    first = pm.allocate(11)
    pm.release(first[5:])  # released last-first: 11, 10, ... 6, then (below) 3, 1, 5, 2, 4
    pm.release([first[i] for i in (3, 1, 4, 0, 2)])
    again = pm.allocate(8)
    assert again == sorted(again) and len(set(again)) == 8
    assert set(again) < set(first)
    pm.release(again)
    pm.check_integrity()

# ---- prefix cache -------------------------------------------------------------------------------
def test_freed_keyed_pages_are_found_again_until_evicted_lru_first():
    pm = PageManager(5, 16)  # 4 usable pages
    a, b = pm.allocate(2), pm.allocate(2)
    for page, key in zip(a + b, (11, 12, 21, 22)):
        pm.register(page, key)
    pm.release(a)
    pm.release(b)  # b freed after a: a is the least recently used
    assert pm.num_free_pages == 4 and pm.num_cached_pages == 4
    assert pm.lookup([11, 12, 99]) == a  # the prefix stops at the first unknown key
    pm.release(a)
    fresh = pm.allocate(2)  # evicts the LRU cached pages: b's (a was just used again)
    assert sorted(fresh) == sorted(b)
    assert pm.lookup([21]) == [] and pm.lookup([11]) == a[:1]
    pm.release(a[:1])
    pm.release(fresh)
    pm.check_integrity()


def test_unkeyed_pages_are_reused_before_cached_ones():
    pm = PageManager(4, 16)
    keyed, plain = pm.allocate(1), pm.allocate(1)
    pm.register(keyed[0], 7)
    pm.release(keyed)
    pm.release(plain)
    assert pm.allocate(1) == plain  # the cached page survives
    assert pm.lookup([7]) == keyed
    pm.check_integrity()


def test_duplicate_key_keeps_the_first_page_and_reset_forgets_everything():
    pm = PageManager(4, 16)
    first, second = pm.allocate(1), pm.allocate(1)
    pm.register(first[0], 5)
    pm.register(second[0], 5)  # computed concurrently: the second copy stays private
    assert pm.num_cached_pages == 1
    pm.release(first + second)
    pm.reset_prefix_cache()
    assert pm.lookup([5]) == [] and pm.num_cached_pages == 0
    with pytest.raises(RuntimeError, match="registering free page"):
        pm.register(first[0], 6)
    pm.check_integrity()


# ---- cached tails (partial last pages) ----------------------------------------------------------
def test_a_released_tail_is_found_by_its_owner_and_longest_shared_prefix():
    pm = PageManager(6, 4)
    short, long_ = pm.allocate(1), pm.allocate(1)
    pm.register_tail(short[0], (11, b""), (5, 6))
    pm.register_tail(long_[0], (11, b""), (5, 6, 7))
    pm.release(short + long_)
    assert pm.num_free_pages == 5 and pm.num_cached_tails == 2
    assert pm.tail_match((11, b""), [5, 6, 7]) == (long_[0], 3)
    assert pm.tail_match((11, b""), [5, 6, 9]) in {(short[0], 2), (long_[0], 2)}
    assert pm.tail_match((11, b""), [5, 8]) in {(short[0], 1), (long_[0], 1)}
    assert pm.tail_match((11, b""), [9]) is None
    assert pm.tail_match((12, b""), [5, 6, 7]) is None  # other full pages before it
    assert pm.tail_match((11, b"salt"), [5, 6, 7]) is None  # another cache salt
    pm.check_integrity()


def test_tails_are_reused_after_unkeyed_pages_and_forgotten_when_evicted_or_reset():
    pm = PageManager(4, 4)  # 3 usable pages
    tail, plain = pm.allocate(1), pm.allocate(1)
    pm.register_tail(tail[0], (0, b""), (1, 2, 3))
    pm.release(tail + plain)
    assert pm.allocate(1) == plain  # the cached tail survives
    other = pm.allocate(1)
    assert other != tail and pm.tail_match((0, b""), [1, 2, 3]) == (tail[0], 3)
    evicting = pm.allocate(1)  # the last free page is the tail: evicted, forgotten
    assert evicting == tail and pm.tail_match((0, b""), [1, 2, 3]) is None and pm.num_cached_tails == 0
    pm.release(plain + other + evicting)
    again = pm.allocate(1)
    pm.register_tail(again[0], (0, b""), (4,))
    pm.release(again)
    pm.reset_prefix_cache()
    assert pm.tail_match((0, b""), [4]) is None
    pm.check_integrity()


def test_a_tail_must_be_held_partial_and_not_a_full_cached_page():
    pm = PageManager(4, 4)
    page = pm.allocate(1)
    pm.register(page[0], 99)
    pm.register_tail(page[0], (0, b""), (1,))  # a full page's key wins: not also a tail
    assert pm.num_cached_tails == 0
    other = pm.allocate(1)
    pm.register_tail(other[0], (0, b""), (1, 2, 3, 4))  # a whole page is no tail
    pm.register_tail(other[0], (0, b""), ())
    assert pm.num_cached_tails == 0
    pm.release(page + other)
    with pytest.raises(RuntimeError, match="registering free page"):
        pm.register_tail(other[0], (0, b""), (1,))
    pm.check_integrity()


def test_an_owner_keeps_its_newest_tails_only():
    pm = PageManager(PageManager.MAX_TAILS_PER_OWNER + 3, 4)
    pages = pm.allocate(PageManager.MAX_TAILS_PER_OWNER + 1)
    for token, page in enumerate(pages):
        pm.register_tail(page, (7, b""), (token,))
    assert pm.num_cached_tails == PageManager.MAX_TAILS_PER_OWNER
    assert pm.tail_match((7, b""), [0]) is None  # the oldest was dropped
    assert pm.tail_match((7, b""), [len(pages) - 1]) == (pages[-1], 1)
    pm.release(pages)
    pm.check_integrity()
