"""The scheduler's cached partial pages (tails): a request continuing a finished one's tokens starts from a copy of
its last, partial page, or waits with nothing of it taken."""
from __future__ import annotations

from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler
from tests.jvllm.test_scheduler import FAKE_TOKEN, S, make_request, make_scheduler, step


def _finish_prompt(sched: Scheduler, request: Request) -> list[int]:
    """Run a request's prompt and first token, then finish it (its partial last page becomes a cached tail).
    -> the pages it held."""
    sched.add(request)
    while not request.output_token_ids:
        step(sched)
    pages = list(request.page_table)
    sched.finish(request, S.FINISHED_STOPPED)
    return pages


def test_a_request_continuing_a_finished_one_starts_from_a_copy_of_its_tail():
    sched = make_scheduler(num_pages=16, page_size=4, max_num_batched_tokens=64, prefix_caching=True)
    parent = make_request(prompt_len=10, rid="parent")  # 2 full pages + 2 tokens
    parent_pages = _finish_prompt(sched, parent)
    assert sched.pages.num_cached_tails == 1
    child = Request("child", None, parent.prompt_token_ids + [FAKE_TOKEN, 5], parent.params, seed=0,
                    max_total_tokens=1024)  # a beam's next round: the parent's tokens and more
    sched.add(child)
    (chunk,) = step(sched).chunks
    assert chunk.start == 10 and chunk.num_tokens == 2 and child.num_cached_tokens == 10
    assert child.page_table[:2] == parent_pages[:2]  # the full pages, shared
    assert chunk.page_copy == (parent_pages[2], child.page_table[2])  # the tail, copied


def test_a_tail_shared_in_part_is_copied_and_its_other_tokens_recomputed():
    sched = make_scheduler(num_pages=16, page_size=4, max_num_batched_tokens=64, prefix_caching=True)
    parent = make_request(prompt_len=7, rid="parent")  # 1 full page + 3 tokens, and the sampled token
    _finish_prompt(sched, parent)
    prompt = parent.prompt_token_ids[:5] + [999, 998, 997]  # shares 1 of the tail's tokens
    child = Request("child", None, prompt, parent.params, seed=0, max_total_tokens=1024)
    sched.add(child)
    (chunk,) = step(sched).chunks
    assert chunk.start == 5 and chunk.num_tokens == 3 and chunk.page_copy is not None


def test_no_tail_for_the_last_token_or_without_prefix_caching():
    for caching in (True, False):
        sched = make_scheduler(num_pages=16, page_size=4, max_num_batched_tokens=64, prefix_caching=caching)
        parent = make_request(prompt_len=6, rid="parent")
        _finish_prompt(sched, parent)
        assert sched.pages.num_cached_tails == (1 if caching else 0)
        same = Request("same", None, parent.prompt_token_ids[:6], parent.params, seed=0, max_total_tokens=1024)
        sched.add(same)
        (chunk,) = step(sched).chunks
        # the same prompt: its last token is computed again, so it has logits to sample from
        assert (chunk.start, chunk.num_tokens) == ((5, 1) if caching else (0, 6))
        assert (chunk.page_copy is not None) == caching


def test_a_tail_copy_is_undone_with_its_lookup_when_the_request_waits():
    sched = make_scheduler(num_pages=6, page_size=4, max_num_batched_tokens=64, prefix_caching=True)
    parent = make_request(prompt_len=6, rid="parent")
    _finish_prompt(sched, parent)
    blocker = make_request(prompt_len=12, max_tokens=8, rid="blocker", variant=1)  # holds 3 of the 5 pages
    sched.add(blocker)
    step(sched)
    child = Request("child", None, parent.prompt_token_ids + [FAKE_TOKEN] + [3] * 8, parent.params, seed=0,
                    max_total_tokens=1024)  # needs 4 pages: it waits
    sched.add(child)
    out = step(sched)
    assert all(c.request is not child for c in out.chunks)
    assert child.page_table == [] and child.num_computed_tokens == 0 and child.tail_copy is None
    assert child.num_cached_tokens == 0
    sched.pages.check_integrity()
