"""The encoder cache and the scheduler's encoder budget, in plain Python: rows for new images, pins while a request
still has placeholder tokens to compute, least-recently-used eviction of unpinned images only, chunks stopped before
an image that cannot be encoded this step, and prefix-cache keys that include the images."""
from __future__ import annotations

from jvllm.core.encoder_cache import EncoderBudget, EncoderCache, MultiModalItem
from jvllm.core.kv_pages import PageManager
from jvllm.core.prefix_cache import request_page_keys
from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler
from jvllm.sampling_params import SamplingParams

IMAGE = 9  # the placeholder token id


def _request(rid: str, layout: list, max_tokens: int = 4) -> Request:
    """layout: ints are text tokens, (hash, length) tuples are images."""
    ids, items = [], []
    for part in layout:
        if isinstance(part, tuple):
            items.append(MultiModalItem("image", part[0], len(ids), part[1], data=None))
            ids += [IMAGE] * part[1]
        else:
            ids.append(part)
    request = Request(rid, None, ids, SamplingParams(max_tokens=max_tokens), 0, 4096)
    request.mm_items = items
    return request


def test_rows_pins_and_lru_eviction():
    cache = EncoderCache(num_rows=4 * 16, block_rows=16)  # 3 usable blocks
    budget = EncoderBudget(tokens_left=1000)
    a, b = _request("a", [1, (101, 20), 2]), _request("b", [(102, 16), 3, (103, 10)])
    assert cache.schedule(a, 0, a.num_tokens, budget) == a.num_tokens  # 2 blocks
    assert cache.schedule(b, 0, b.num_tokens, budget) == 17  # 102 fits (1 block); 103 finds no room: stop before it
    assert list(budget.to_encode) == [101, 102] and budget.tokens_left == 1000 - 36
    assert cache.item_rows(101) == [16 + i for i in range(16)] + [32 + i for i in range(4)]  # blocks 1, 2
    assert cache.token_rows(a, 0, 3) == [-1, 16, 17] and cache.token_rows(b, 15, 2) == [48 + 15, -1]
    cache.mark_ready([item for _, item in budget.to_encode.values()])
    a.num_computed_tokens = a.num_tokens
    cache.release_passed(a)  # 101 unpinned, still cached
    assert 101 in cache and cache.num_pinned == 1
    budget = EncoderBudget(tokens_left=1000)
    assert cache.schedule(b, 17, b.num_tokens - 17, budget) == b.num_tokens - 17  # 103 evicts 101 (unpinned)
    assert 101 not in cache and 102 in cache and list(budget.to_encode) == [103]
    cache.check_integrity()
    # everything pinned: a new image cannot get rows, and nothing changes
    c = _request("c", [(104, 40)])
    assert cache.schedule(c, 0, c.num_tokens, EncoderBudget(1000)) == 0
    cache.check_integrity()
    cache.release(b)
    assert cache.schedule(c, 0, c.num_tokens, EncoderBudget(1000)) == c.num_tokens
    assert 102 not in cache and 103 not in cache
    cache.check_integrity()


def test_hits_count_images_found_encoded():
    cache = EncoderCache(num_rows=8 * 16, block_rows=16)
    first, second = _request("1", [(7, 16), 1]), _request("2", [2, (7, 16)])
    budget = EncoderBudget(1000)
    cache.schedule(first, 0, first.num_tokens, budget)
    cache.mark_ready([item for _, item in budget.to_encode.values()])
    budget = EncoderBudget(1000)
    cache.schedule(second, 0, second.num_tokens, budget)
    assert not budget.to_encode and (cache.queries, cache.hits) == (2, 1)


def test_an_item_allocated_but_never_encoded_is_encoded_by_its_next_user():
    cache = EncoderCache(num_rows=8 * 16, block_rows=16)
    a, b = _request("a", [(5, 16)]), _request("b", [(5, 16)])
    budget = EncoderBudget(1000)
    cache.schedule(a, 0, a.num_tokens, budget)
    budget.drop("a")  # a's chunk was not scheduled after all
    cache.release(a)
    assert not budget.to_encode and budget.tokens_left == 1000 and not cache.is_ready(5)
    budget = EncoderBudget(1000)
    cache.schedule(b, 0, b.num_tokens, budget)
    assert list(budget.to_encode) == [5]


def _scheduler(encoder_tokens: int, cache_rows: int = 40 * 16, batched: int = 256) -> Scheduler:
    return Scheduler(PageManager(64, 16), max_num_seqs=8, max_num_batched_tokens=batched,
                     encoder_cache=EncoderCache(cache_rows, 16), max_num_encoder_tokens=encoder_tokens)


def test_the_encoder_budget_stops_chunks_before_images_it_cannot_take():
    scheduler = _scheduler(encoder_tokens=32)
    a = _request("a", [1, 2, (11, 32), 3])
    b = _request("b", [4, 5, 6, (12, 32), 7])
    scheduler.add(a)
    scheduler.add(b)
    chunks = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in chunks] == [("a", a.num_tokens), ("b", 3)]
    assert [item.hash for item in chunks[0].encode] == [11] and chunks[1].encode == []
    scheduler.commit(chunks)
    chunks = scheduler.schedule()  # a has computed its prompt (its first token is not appended here): b goes on
    assert [(c.request.request_id, c.num_tokens, [i.hash for i in c.encode]) for c in chunks
            if c.request is b] == [("b", b.num_tokens - 3, [12])]
    scheduler.commit(chunks)
    assert scheduler.encoder_cache.num_pinned == 0  # both passed their images


def test_preemption_and_finishing_release_pins():
    scheduler = _scheduler(encoder_tokens=1000, batched=16)
    a = _request("a", [1, (21, 32), 2])
    scheduler.add(a)
    chunks = scheduler.schedule()  # 16 tokens: into the image span
    assert chunks[0].num_tokens == 16 and [i.hash for i in chunks[0].encode] == [21]
    scheduler.commit(chunks)
    assert scheduler.encoder_cache.num_pinned == 1
    scheduler._preempt(a)
    assert scheduler.encoder_cache.num_pinned == 0 and scheduler.encoder_cache.is_ready(21)
    chunks = scheduler.schedule()
    assert chunks[0].encode == []  # still cached: not encoded again
    scheduler.commit(chunks)
    from jvllm.core.request import RequestStatus

    scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    assert scheduler.encoder_cache.num_pinned == 0


def test_prefix_keys_differ_exactly_on_pages_holding_different_images():
    x = _request("x", [*range(20, 40), (1111, 16), *range(40, 60)])
    y = _request("y", [*range(20, 40), (2222, 16), *range(40, 60)])
    z = _request("z", [*range(20, 40), (1111, 16), *range(40, 60)])
    kx, ky, kz = (request_page_keys(r, 3, 16) for r in (x, y, z))
    assert kx[0] == ky[0] and kx[1] != ky[1] and kx[2] != ky[2]  # the image starts at token 20, in page 1
    assert kx == kz
