"""Scheduler driven directly, no model: budget, FCFS, chunked prefill, preemption, page accounting."""
from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jvllm.core.kv_pages import PageManager
from jvllm.core.request import Request, RequestStatus
from jvllm.sampling_params import SamplingParams
from jvllm.core.scheduler import ScheduledChunk, Scheduler

S = RequestStatus
FAKE_TOKEN = 42
_ids = itertools.count()


def make_scheduler(num_pages: int = 64, page_size: int = 4, max_num_seqs: int = 4,
                   max_num_batched_tokens: int = 16, prefix_caching: bool = False) -> Scheduler:
    return Scheduler(PageManager(num_pages, page_size), max_num_seqs, max_num_batched_tokens,
                     enable_prefix_caching=prefix_caching)


def make_request(prompt_len: int, max_tokens: int | None = 4, max_total: int = 1024,
                 rid: str | None = None, variant: int = 0, diverge_at: int = 0) -> Request:
    """Prompts share their first `diverge_at` tokens with every other variant's (a prefix-cache workload)."""
    rid = rid if rid is not None else f"r{next(_ids)}"
    prompt = [(7 * i + 3 + (variant if i >= diverge_at else 0)) % 1000 for i in range(prompt_len)]
    return Request(rid, None, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0,
                   max_total_tokens=max_total)


@dataclasses.dataclass
class StepOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request]  # requests the step preempted (their preemption count went up)


def schedule(sched: Scheduler) -> StepOutput:
    before = {id(r): r.num_preemptions for r in [*sched.running, *sched.waiting]}
    candidates = list(sched.running)
    chunks = sched.schedule()
    return StepOutput(chunks, [r for r in candidates if r.num_preemptions > before[id(r)]])


def check_output(sched: Scheduler, out: StepOutput, budget_before_unfinished: bool) -> None:
    """Invariants of one schedule() result, checked before commit()."""
    requests = [c.request for c in out.chunks]
    assert len(set(map(id, requests))) == len(requests), "a request was scheduled twice in one step"
    assert sum(c.num_tokens for c in out.chunks) <= sched.max_num_batched_tokens
    assert len(out.chunks) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    if budget_before_unfinished:
        assert out.chunks, "unfinished requests but nothing scheduled (deadlock)"
    for chunk in out.chunks:
        request = chunk.request
        assert request.status is S.RUNNING and request in sched.running
        assert chunk.num_tokens >= 1
        assert chunk.start == request.num_computed_tokens
        assert chunk.start + chunk.num_tokens <= request.num_tokens
        assert chunk.samples == (chunk.start + chunk.num_tokens == request.num_tokens)
        # the pages for the chunk's KV are in place before the model runs
        assert len(request.page_table) * sched.pages.page_size >= chunk.start + chunk.num_tokens
        if chunk.page_copy is not None:  # started from a cached tail: its copy is the request's own page
            source, target = chunk.page_copy
            assert request.page_table[chunk.start // sched.pages.page_size] == target
            # The source may be handed out again in the same step, even as this request's next page (a small pool):
            # allocation forgets the tail, and the step's page copies run before it writes any KV.
            assert source != target
    for victim in out.preempted:
        assert victim not in requests, "a preempted request still has a chunk"
        assert victim.status is S.WAITING
        assert victim.num_computed_tokens == 0 and victim.page_table == []
        assert victim in sched.waiting and victim not in sched.running


def check_state(sched: Scheduler) -> None:
    """Page accounting between steps: running requests hold exactly the used pages, and a page's reference
    count is the number of requests holding it (only prefix-cache hits share pages)."""
    pages = sched.pages
    pages.check_integrity()
    held = [p for r in sched.running for p in r.page_table]
    if not sched.enable_prefix_caching:
        assert len(held) == len(set(held)), "two running requests share a page"
    for page, owners in collections.Counter(held).items():
        assert pages._refcount[page] == owners, f"page {page}: refcount {pages._refcount[page]}, {owners} owners"
    used = set(range(1, pages.num_pages)) - set(pages._free)
    assert set(held) == used, f"leaked pages {used - set(held)}, unaccounted {set(held) - used}"
    assert pages.num_free_pages == pages.num_usable_pages - len(set(held))
    for request in sched.running:
        assert request.status is S.RUNNING
        assert len(request.page_table) == pages.pages_for_tokens(request.num_computed_tokens)
        assert request.num_computed_tokens < request.num_tokens
    for request in sched.waiting:
        assert request.status is S.WAITING
        assert request.page_table == [] and request.num_computed_tokens == 0
    assert len(sched.running) <= sched.max_num_seqs


def step(sched: Scheduler) -> StepOutput:
    """One engine step with a fake model: schedule, commit, append a token per sampling chunk."""
    had_work = sched.has_unfinished()
    out = schedule(sched)
    check_output(sched, out, had_work)
    sched.commit(out.chunks)
    for chunk in out.chunks:
        if chunk.samples:
            request = chunk.request
            request.output_token_ids.append(FAKE_TOKEN)
            if len(request.output_token_ids) >= request.max_output_tokens:
                sched.finish(request, S.FINISHED_LENGTH)
    check_state(sched)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[StepOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps, "no progress"
    return outs


# ---------------------------------------------------------------------------------------------------
def test_single_request_prefill_then_decode():
    sched = make_scheduler()
    request = make_request(prompt_len=10, max_tokens=3)
    sched.add(request)
    outs = run_to_completion(sched)
    assert [[(c.start, c.num_tokens, c.samples) for c in o.chunks] for o in outs] == [
        [(0, 10, True)], [(10, 1, True)], [(11, 1, True)]]
    assert request.status is S.FINISHED_LENGTH and request.status.finish_reason == "length"
    assert request.output_token_ids == [FAKE_TOKEN] * 3
    assert request.page_table == []
    assert sched.pages.num_free_pages == sched.pages.num_usable_pages
    assert request.first_scheduled_time is not None


def test_token_budget_and_max_num_seqs_respected_every_step():
    sched = make_scheduler(num_pages=200, max_num_seqs=3, max_num_batched_tokens=20)
    requests = [make_request(prompt_len=n, max_tokens=m)
                for n, m in [(5, 6), (30, 2), (1, 9), (17, 3), (8, 8), (21, 1), (2, 5), (40, 4)]]
    for request in requests:
        sched.add(request)
    outs = run_to_completion(sched)  # step() checks the budget and the seq limit
    assert max(sum(c.num_tokens for c in o.chunks) for o in outs) == 20  # the budget is used fully at times
    assert max(len(o.chunks) for o in outs) == 3
    assert all(r.status is S.FINISHED_LENGTH and len(r.output_token_ids) == r.params.max_tokens for r in requests)
    assert sched.num_preemptions == 0


def test_running_requests_never_exceed_max_num_seqs_even_with_budget_left():
    sched = make_scheduler(num_pages=200, max_num_seqs=2, max_num_batched_tokens=100)
    for _ in range(5):
        sched.add(make_request(prompt_len=3, max_tokens=4))
    out = step(sched)
    assert len(out.chunks) == 2 and len(sched.running) == 2 and len(sched.waiting) == 3


def test_fcfs_admission_order():
    sched = make_scheduler(num_pages=200, max_num_seqs=2, max_num_batched_tokens=64)
    requests = [make_request(prompt_len=3 + (i * 5) % 11, max_tokens=1 + (i * 3) % 5, rid=f"q{i}")
                for i in range(9)]
    for request in requests:
        sched.add(request)
    admitted: list[str] = []
    for out in run_to_completion(sched):
        for chunk in out.chunks:
            if chunk.start == 0:
                admitted.append(chunk.request.request_id)
    assert admitted == [r.request_id for r in requests]


def test_fcfs_head_of_queue_is_not_overtaken():
    # 8 usable pages of 4 tokens; the first request holds 6, the head of the queue needs 3, the next one 1.
    sched = make_scheduler(num_pages=9, max_num_seqs=4, max_num_batched_tokens=64)
    big = make_request(prompt_len=24, max_tokens=4)
    head = make_request(prompt_len=12, max_tokens=1)
    small = make_request(prompt_len=2, max_tokens=1)
    sched.add(big)
    step(sched)
    sched.add(head)
    sched.add(small)
    out = step(sched)
    assert [c.request for c in out.chunks] == [big]  # `small` would fit but must wait behind `head`
    assert list(sched.waiting) == [head, small]
    run_to_completion(sched)
    assert head.first_scheduled_time <= small.first_scheduled_time
    assert all(r.status is S.FINISHED_LENGTH for r in (big, head, small))


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples():
    sched = make_scheduler(num_pages=64, max_num_batched_tokens=16)
    request = make_request(prompt_len=50, max_tokens=2)
    sched.add(request)
    outs = run_to_completion(sched)
    chunks = [(c.start, c.num_tokens, c.samples) for o in outs for c in o.chunks]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True)]
    assert request.output_token_ids == [FAKE_TOKEN] * 2


def test_chunked_prefill_shares_the_budget_with_decodes():
    sched = make_scheduler(num_pages=64, max_num_seqs=4, max_num_batched_tokens=16)
    first = make_request(prompt_len=4, max_tokens=10)
    sched.add(first)
    step(sched)  # first is decoding from now on
    long = make_request(prompt_len=40, max_tokens=1)
    sched.add(long)
    seen = []
    while long.status is not S.FINISHED_LENGTH:
        out = step(sched)
        assert out.chunks[0].request is first and out.chunks[0].num_tokens == 1  # decodes go first
        seen += [(c.num_tokens, c.samples) for c in out.chunks if c.request is long]
    assert seen == [(15, False), (15, False), (10, True)]


def test_preemption_by_recompute_with_a_tiny_pool():
    # 8 usable pages of 4 tokens = 32 KV tokens; 4 requests of up to 6 + 10 - 1 = 15 tokens (4 pages) each.
    sched = make_scheduler(num_pages=9, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(prompt_len=6, max_tokens=10, rid=f"p{i}") for i in range(4)]
    for request in requests:
        sched.add(request)
    preempted_ids: set[str] = set()
    readmitted: set[str] = set()
    steps = 0
    while sched.has_unfinished():
        out = step(sched)  # checks preempted requests are WAITING with nothing computed and no pages
        steps += 1
        assert steps < 1000
        for victim in out.preempted:
            preempted_ids.add(victim.request_id)
            assert victim.output_token_ids, "only requests that grew past their first pages get preempted here"
        for chunk in out.chunks:
            request = chunk.request
            if request.request_id in preempted_ids and chunk.start == 0:
                readmitted.add(request.request_id)
                # recompute covers the prompt and every token generated so far, then samples the next one
                # (step() has already appended this step's sampled token)
                assert chunk.samples and chunk.num_tokens == request.num_tokens - 1
                assert len(request.output_token_ids) >= 2
    assert sched.num_preemptions > 0
    assert sched.num_preemptions == sum(r.num_preemptions for r in requests)
    assert preempted_ids and readmitted == preempted_ids
    assert requests[0].num_preemptions == 0  # victims come from the back of the running list
    for request in requests:
        assert request.status is S.FINISHED_LENGTH
        assert len(request.output_token_ids) == 10
        assert request.page_table == []
    assert sched.pages.num_free_pages == sched.pages.num_usable_pages


def test_preempted_requests_keep_fcfs_order_at_the_front_of_the_queue():
    sched = make_scheduler(num_pages=9, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(prompt_len=8, max_tokens=8, rid=f"f{i}") for i in range(4)]
    late = make_request(prompt_len=2, max_tokens=2, rid="late")
    for request in requests:
        sched.add(request)
    step(sched)  # all four admitted, 2 pages each: the pool is full
    sched.add(late)
    out = step(sched)  # every decode needs a third page
    assert out.preempted, "expected preemptions"
    queue = [r.request_id for r in sched.waiting]
    victims = [r.request_id for r in out.preempted]
    assert queue[-1] == "late"
    assert queue[:-1] == sorted(victims)  # earliest arrival first, ahead of the never-run request
    run_to_completion(sched)
    assert all(r.status is S.FINISHED_LENGTH for r in requests + [late])


def test_request_that_never_fits_is_rejected_with_a_clear_message():
    sched = make_scheduler(num_pages=5, page_size=4)  # 16 KV tokens
    too_big = make_request(prompt_len=10, max_tokens=8)  # needs 10 + 8 - 1 = 17
    with pytest.raises(ValueError, match=r"needs KV space for 17 tokens.*holds 16 tokens"):
        sched.check_fits(too_big)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        sched.add(too_big)
    assert not sched.has_unfinished()
    huge_prompt = make_request(prompt_len=20, max_tokens=1)
    with pytest.raises(ValueError, match=huge_prompt.request_id):
        sched.add(huge_prompt)
    no_limit = make_request(prompt_len=4, max_tokens=None, max_total=64)  # up to max_model_len
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(no_limit)
    assert not sched.waiting


def test_request_that_exactly_fits_the_pool_completes():
    sched = make_scheduler(num_pages=5, page_size=4, max_num_batched_tokens=64)  # 16 KV tokens
    request = make_request(prompt_len=10, max_tokens=7)  # the last sampled token's KV is never written
    sched.add(request)
    run_to_completion(sched)
    assert request.status is S.FINISHED_LENGTH and len(request.output_token_ids) == 7


def test_abort_waiting_and_running_requests_frees_pages():
    sched = make_scheduler(num_pages=20, max_num_seqs=1)
    running = make_request(prompt_len=9, max_tokens=5)
    waiting = make_request(prompt_len=9, max_tokens=5)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert running.page_table and not waiting.page_table
    sched.finish(waiting, S.FINISHED_ABORTED)
    sched.finish(running, S.FINISHED_ABORTED)
    check_state(sched)
    assert not sched.has_unfinished()
    assert running.status.finish_reason == waiting.status.finish_reason == "abort"
    assert sched.pages.num_free_pages == sched.pages.num_usable_pages
    assert not sched.schedule()


def test_finishing_an_already_finished_request_raises():
    sched = make_scheduler()
    request = make_request(prompt_len=3, max_tokens=1)
    sched.add(request)
    run_to_completion(sched)
    with pytest.raises(RuntimeError, match="illegal transition"):
        sched.finish(request, S.FINISHED_ABORTED)
    sched.pages.check_integrity()
    assert sched.pages.num_free_pages == sched.pages.num_usable_pages


def test_rejected_finish_leaves_the_request_queued():
    sched = make_scheduler()
    request = make_request(prompt_len=3)
    sched.add(request)
    with pytest.raises(RuntimeError, match="illegal transition WAITING -> FINISHED_LENGTH"):
        sched.finish(request, S.FINISHED_LENGTH)  # only an abort may end a waiting request
    assert request.status is S.WAITING
    assert list(sched.waiting) == [request] and sched.has_unfinished()


# --------------------------------------------------------------------------------------------------- property
_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 1000), st.one_of(st.none(), st.integers(1, 16))),  # may not fit
    st.tuples(st.just("add"), st.integers(0, 1000), st.integers(-1000, -1)),  # sized to fit the pool
    st.tuples(st.just("add"), st.integers(0, 1000), st.integers(-1000, -1)),  # sized to fit the pool
    st.tuples(st.just("add"), st.integers(0, 1000), st.integers(-1000, -1)),  # sized to fit the pool
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 100), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 100), st.just(0)),
)


@settings(max_examples=400, deadline=None)
@given(num_pages=st.integers(2, 14), page_size=st.sampled_from([2, 4, 8]), max_num_seqs=st.integers(1, 5),
       budget=st.integers(1, 24), max_total=st.integers(8, 64), ops=st.lists(_op, min_size=5, max_size=80),
       prefix_caching=st.booleans())
def test_random_workload_keeps_pages_consistent(num_pages, page_size, max_num_seqs, budget, max_total, ops,
                                                prefix_caching):
    """add / step / abort / finish in any order on a small pool: pages are never leaked, double freed or
    shared except through prefix-cache hits (prompts share prefixes of random lengths)."""
    sched = make_scheduler(num_pages, page_size, max_num_seqs, budget, prefix_caching)
    # prompts up to the whole pool (or max_model_len), so both fitting and oversized requests occur
    longest_prompt = min(max_total - 1, sched.max_kv_tokens())
    everyone: list[Request] = []
    for op, a, b in ops:
        if op == "add":
            prompt_len = 1 + a % longest_prompt
            if b is not None and b < 0:  # a max_tokens that fits: prompt + max_tokens - 1 <= pool
                b = 1 + (-b) % (sched.max_kv_tokens() - prompt_len + 1)
            request = make_request(prompt_len=prompt_len, max_tokens=b, max_total=max_total, variant=a % 3,
                                   diverge_at=a % 13)
            needed = prompt_len + request.max_output_tokens - 1
            if needed > sched.max_kv_tokens():
                with pytest.raises(ValueError):
                    sched.add(request)
                assert request.status is S.WAITING and request not in sched.waiting
            else:
                sched.add(request)
                everyone.append(request)
        elif op == "step":
            step(sched)
        elif op == "abort":
            live = list(sched.running) + list(sched.waiting)
            if live:
                sched.finish(live[a % len(live)], S.FINISHED_ABORTED)
        elif op == "finish" and sched.running:  # e.g. EOS sampled: only running requests stop this way
            sched.finish(sched.running[a % len(sched.running)], S.FINISHED_STOPPED)
        check_state(sched)
    run_to_completion(sched)
    for request in everyone:
        assert request.is_finished and request.page_table == []
        if request.status is S.FINISHED_LENGTH:
            assert len(request.output_token_ids) == request.max_output_tokens
    assert sched.num_preemptions == sum(r.num_preemptions for r in everyone)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix cache hits: {sched.prefix_cache_hits > 0}")
    event(f"tails cached: {sched.pages.num_cached_tails > 0}")
    event(f"requests: {min(len(everyone), 5)}{'+' if len(everyone) >= 5 else ''}")
    sched.pages.check_integrity()
    assert sched.pages.num_free_pages == sched.pages.num_usable_pages
