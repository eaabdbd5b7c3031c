"""The priority scheduling policy, scheduler alone: queue order, preemption of lower priorities, page accounting."""
from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jvllm.core.kv_pages import PageManager
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler, check_priority, priority_order
from tests.jvllm.test_scheduler import check_state, make_request, run_to_completion, step

S = RequestStatus


def priority_scheduler(num_pages: int = 64, page_size: int = 4, max_num_seqs: int = 4,
                       max_num_batched_tokens: int = 16) -> Scheduler:
    return Scheduler(PageManager(num_pages, page_size), max_num_seqs, max_num_batched_tokens, policy="priority")


def ranked(prompt_len: int, priority: int, max_tokens: int = 4, arrival: float | None = None) -> Request:
    request = make_request(prompt_len=prompt_len, max_tokens=max_tokens)
    request.priority = priority
    if arrival is not None:
        request.arrival_time = arrival
    return request


def running_order_holds(sched: Scheduler) -> bool:
    keys = [priority_order(r) for r in sched.running]
    return keys == sorted(keys)


def test_a_priority_needs_the_priority_policy():
    check_priority(0, "fcfs")
    check_priority(-3, "priority")
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        check_priority(1, "fcfs")
    for bad in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="integer"):
            check_priority(bad, "priority")


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = priority_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    requests = [ranked(4, p, max_tokens=1, arrival=t) for t, p in enumerate([3, 1, 2, 1, 0])]
    for request in requests:
        sched.add(request)
    admitted = [chunk.request for out in run_to_completion(sched) for chunk in out.chunks]
    assert admitted == [requests[i] for i in (4, 1, 3, 2, 0)]


def test_a_higher_priority_request_takes_the_slot_of_the_lowest_running_one():
    sched = priority_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    low = [ranked(4, 5, max_tokens=20, arrival=t) for t in range(2)] + [ranked(4, 7, max_tokens=20, arrival=2)]
    for request in low:
        sched.add(request)
    step(sched)
    urgent = ranked(4, 0, max_tokens=2, arrival=3)
    sched.add(urgent)
    out = step(sched)
    assert out.preempted == [low[2]]  # the lowest priority, not the latest arrival among equals
    assert urgent in [c.request for c in out.chunks] and urgent.output_token_ids  # its first token, this step
    assert list(sched.waiting) == [low[2]] and running_order_holds(sched)
    run_to_completion(sched)
    assert all(r.status is S.FINISHED_LENGTH for r in [*low, urgent])


def test_a_higher_priority_request_frees_pages_held_by_lower_ones():
    sched = priority_scheduler(num_pages=9, page_size=4, max_num_seqs=8, max_num_batched_tokens=64)  # 32 tokens
    low = [ranked(12, 5, max_tokens=4, arrival=t) for t in range(2)]  # 3 pages each, a 4th once decoding
    for request in low:
        sched.add(request)
    step(sched)
    urgent = ranked(12, 1, max_tokens=2, arrival=5)  # needs 3 pages, 2 are free
    sched.add(urgent)
    out = step(sched)
    assert out.preempted == [low[1]] and urgent in [c.request for c in out.chunks]
    assert running_order_holds(sched)
    run_to_completion(sched)
    assert all(r.status is S.FINISHED_LENGTH for r in [*low, urgent])


def test_equal_priorities_never_preempt_for_admission():
    sched = priority_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    first = [ranked(4, 2, max_tokens=6, arrival=t) for t in range(2)]
    for request in first:
        sched.add(request)
    step(sched)
    later = ranked(4, 2, max_tokens=1, arrival=9)
    sched.add(later)
    out = step(sched)
    assert not out.preempted and later not in [c.request for c in out.chunks]


def test_running_out_of_pages_preempts_the_lowest_priority_first():
    sched = priority_scheduler(num_pages=7, page_size=4, max_num_seqs=3, max_num_batched_tokens=64)  # 24 tokens
    important, middle, least = ranked(6, 0, 12, 0), ranked(6, 1, 12, 1), ranked(6, 2, 12, 2)
    for request in (least, middle, important):
        sched.add(request)
    victims = [victim for out in run_to_completion(sched) for victim in out.preempted]
    assert victims and victims[0] is least
    assert important.num_preemptions == 0


_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 1000), st.integers(-3, 3)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 100), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(3, 14), page_size=st.sampled_from([2, 4]), max_num_seqs=st.integers(1, 4),
       budget=st.integers(1, 24), ops=st.lists(_op, min_size=5, max_size=60))
def test_random_prioritized_workload_keeps_pages_consistent_and_finishes(num_pages, page_size, max_num_seqs, budget,
                                                                         ops):
    """Any order of adds (random priorities), steps and aborts: the running list stays in priority order, pages
    are never leaked or shared, and every request ends."""
    sched = priority_scheduler(num_pages, page_size, max_num_seqs, budget)
    pool = sched.max_kv_tokens()
    everyone: list[Request] = []
    for op, a, b in ops:
        if op == "add":
            prompt_len = 1 + a % (pool - 1) if pool > 1 else 1
            request = ranked(prompt_len, b, max_tokens=1 + a % max(pool - prompt_len, 1))
            sched.add(request)
            everyone.append(request)
        elif op == "step":
            step(sched)
        elif sched.running or sched.waiting:
            live = [*sched.running, *sched.waiting]
            sched.finish(live[a % len(live)], S.FINISHED_ABORTED)
        check_state(sched)
        assert running_order_holds(sched)
        assert [priority_order(r) for r in sched.waiting] == sorted(priority_order(r) for r in sched.waiting)
    run_to_completion(sched)
    assert all(request.is_finished for request in everyone)
    event(f"preempted: {sched.num_preemptions > 0}")
    sched.pages.check_integrity()
    assert sched.pages.num_free_pages == sched.pages.num_usable_pages


# --------------------------------------------------------------------------------------------------- engine
def test_an_urgent_request_behind_64_running_ones_gets_its_first_token_within_two_steps(tiny_model_factory):
    """64 low-priority requests fill every sequence slot and 8 more wait; a priority-0 request then gets its
    first token within two engine steps (one may be the look-ahead step already in flight)."""
    from jvllm import Engine, SamplingParams

    engine = Engine(model=str(tiny_model_factory("llama")), dtype="float32", max_num_seqs=64,
                    kv_cache_memory_bytes=32 << 20, max_model_len=256, precompile=False,
                    scheduling_policy="priority")
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(72):
        engine.add_request(f"low-{i}", f"background request number {i} says", long, priority=10)
    while len(engine.scheduler.running) < 64 or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    engine.add_request("urgent", "the urgent request", SamplingParams(temperature=0.0, max_tokens=4), priority=0)
    steps = 0
    while not any(o.request_id == "urgent" and o.outputs[0].token_ids for o in engine.step()):
        steps += 1
        assert steps < 2, "the urgent request waited more than two steps"
    assert engine.scheduler.num_preemptions >= 1
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        engine.generate(["x"], long, priority=[0, 1])
    engine.abort_request([f"low-{i}" for i in range(72)] + ["urgent"])
    fcfs = Engine(model=str(tiny_model_factory("llama")), dtype="float32", max_num_seqs=4,
                  kv_cache_memory_bytes=8 << 20, max_model_len=128, precompile=False)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate(["x"], long, priority=[1])
    assert not fcfs.has_unfinished_requests()
