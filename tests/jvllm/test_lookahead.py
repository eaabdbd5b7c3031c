"""Async scheduling's planning, no model: which requests look ahead, page reservation, commit after the fact."""
from __future__ import annotations

from jvllm.core.kv_pages import PageManager
from jvllm.core.lookahead import plan_lookahead, settle_lookahead
from jvllm.core.request import Request, RequestStatus
from jvllm.sampling_params import SamplingParams
from jvllm.core.scheduler import Scheduler

PAGE = 4


def _running(scheduler: Scheduler, prompt_len: int, rid: str, **params) -> Request:
    """A request scheduled and committed once: its prompt is computed, its first token is being sampled."""
    request = Request(rid, None, list(range(10, 10 + prompt_len)),
                      SamplingParams(temperature=0.0, **{"max_tokens": 8, **params}), seed=0, max_total_tokens=64)
    scheduler.add(request)
    return request


def _dispatch_once(scheduler: Scheduler) -> list:
    chunks = scheduler.schedule()
    scheduler.commit(chunks)
    return chunks


def test_every_running_request_looks_ahead_with_a_page_for_its_pending_token():
    scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _running(scheduler, 4, "a"), _running(scheduler, 6, "b")
    chunks = _dispatch_once(scheduler)
    assert [len(a.page_table), len(b.page_table)] == [1, 2]
    ahead = plan_lookahead(scheduler, chunks)
    assert [c.request for c in ahead] == [a, b]
    assert all(c.lookahead and c.samples and c.num_tokens == 1 and c.pending_tokens == 1 for c in ahead)
    assert [c.start for c in ahead] == [4, 6]  # the token being sampled now sits right after the prompt
    assert len(a.page_table) == 2, "a's pending token (index 4) starts a new page"
    assert len(b.page_table) == 2, "b's pending token (index 6) still fits its second page"
    scheduler.pages.check_integrity()


def test_settle_commits_survivors_only():
    scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _running(scheduler, 4, "a"), _running(scheduler, 5, "b")
    ahead = plan_lookahead(scheduler, _dispatch_once(scheduler))
    a.output_token_ids.append(7)  # the previous step's tokens reach the host...
    b.output_token_ids.append(8)
    scheduler.finish(b, RequestStatus.FINISHED_STOPPED)  # ...and b stopped on its
    alive = settle_lookahead(scheduler, ahead)
    assert [c.request for c in alive] == [a]
    assert a.num_computed_tokens == a.num_tokens == 5
    assert b.page_table == [] and b.num_computed_tokens == 5  # finished: its look-ahead row is never committed
    scheduler.pages.check_integrity()


def test_no_lookahead_while_a_request_waits_for_admission():
    scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    _running(scheduler, 4, "a")
    chunks = _dispatch_once(scheduler)
    _running(scheduler, 4, "late")  # the next step must admit it: schedule normally
    free = scheduler.pages.num_free_pages
    assert plan_lookahead(scheduler, chunks) is None
    assert scheduler.pages.num_free_pages == free


def test_no_lookahead_after_a_partial_prefill_chunk():
    scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=8)
    _running(scheduler, 12, "long")  # chunked: the first chunk does not sample
    chunks = _dispatch_once(scheduler)
    assert not chunks[0].samples
    assert plan_lookahead(scheduler, chunks) is None


def test_no_lookahead_when_pages_run_short_and_nothing_is_reserved():
    scheduler = Scheduler(PageManager(4, PAGE), max_num_seqs=4, max_num_batched_tokens=64)  # 3 usable pages
    a, b = _running(scheduler, 4, "a", max_tokens=4), _running(scheduler, 8, "b", max_tokens=4)
    chunks = _dispatch_once(scheduler)
    assert scheduler.pages.num_free_pages == 0
    tables = (list(a.page_table), list(b.page_table))
    assert plan_lookahead(scheduler, chunks) is None  # both need a new page: no preemption, fall back
    assert (a.page_table, b.page_table) == tables


def test_a_request_whose_current_token_is_its_last_sits_out():
    scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    plain = _running(scheduler, 4, "plain")
    _running(scheduler, 4, "last", max_tokens=1)
    ahead = plan_lookahead(scheduler, _dispatch_once(scheduler))
    assert [c.request for c in ahead] == [plain]


def test_any_penalty_in_the_batch_means_no_lookahead():
    """Penalties need every output token on the host; leaving such a request out of the look-ahead step would
    make it advance only every other step, so the whole batch runs synchronously."""
    for penalty in ({"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2}):
        scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
        _running(scheduler, 4, "plain")
        _running(scheduler, 4, "penalized", **penalty)
        assert plan_lookahead(scheduler, _dispatch_once(scheduler)) is None


def test_nothing_to_look_ahead_for():
    scheduler = Scheduler(PageManager(32, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    _running(scheduler, 4, "last", max_tokens=1)
    assert plan_lookahead(scheduler, _dispatch_once(scheduler)) is None
