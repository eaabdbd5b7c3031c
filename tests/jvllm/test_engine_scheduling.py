"""End to end on the real model: chunked prefill and preemption give the same greedy tokens, no page leaks."""
from __future__ import annotations

import pytest

from jvllm import SamplingParams
from jvllm.core.request import RequestStatus

pytestmark = pytest.mark.slow

PROMPT_LEN = 60
NUM_PROMPTS = 8
NUM_OUT = 24
POOL_PAGES = 34  # 33 usable pages x 16 = 528 KV tokens < 8 x (60 + 24 - 1); the prompts alone take 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_OUT, ignore_eos=True)

_TOPICS = ["the history of the printing press", "how bees build their hives", "a recipe for lemon cake",
           "the rules of chess", "why the sky is blue", "the life of a lighthouse keeper",
           "how to repair a bicycle tire", "the moons of Jupiter"]


def _token_prompts(engine) -> list[dict]:
    """Eight different prompts of exactly PROMPT_LEN tokens (one length keeps the compiled shapes few)."""
    tok = engine.get_tokenizer()
    prompts = []
    for topic in _TOPICS:
        text = f"Write a long and detailed essay about {topic}. " * 8
        ids = tok.encode(text)[:PROMPT_LEN]
        assert len(ids) == PROMPT_LEN
        prompts.append({"prompt_token_ids": ids})
    return prompts


def _record_plans(engine) -> list:
    """Wrap this engine's scheduler.schedule (instance attribute only) to keep every step's plan."""
    plans = []
    original = engine.scheduler.schedule

    def schedule():
        plan = original()
        plans.append([(c.request.request_id, c.start, c.num_tokens, c.samples) for c in plan])
        return plan

    engine.scheduler.schedule = schedule
    return plans


def _assert_no_leak(engine) -> None:
    pages = engine.pages
    pages.check_integrity()
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert pages.num_free_pages == pages.num_usable_pages, "KV pages leaked"
    assert engine.get_num_unfinished_requests() == 0


@pytest.fixture(scope="module")
def prompts(default_engine) -> list[dict]:
    return _token_prompts(default_engine)


@pytest.fixture(scope="module")
def reference(default_engine, prompts) -> list[list[int]]:
    """Greedy tokens of every prompt from the big default engine, all in one batch (no preemption)."""
    before = default_engine.scheduler.num_preemptions
    outs = default_engine.generate(prompts, GREEDY, use_tqdm=False)
    assert default_engine.scheduler.num_preemptions == before
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def small_engine(default_engine):
    """A pool of POOL_PAGES pages: too small for all eight requests at once."""
    from jvllm import Engine

    model = default_engine.model
    kv_bytes = default_engine.runner.kv_pool_bytes(model.config, model.dtype, POOL_PAGES, 16)
    engine = Engine(dtype="float32", kv_cache_memory_bytes=kv_bytes, max_num_seqs=8, max_model_len=512,
                    precompile=False)
    assert engine.config.num_pages == POOL_PAGES
    return engine


def test_chunked_prefill_matches_one_shot_prefill(default_engine):
    from jvllm import Engine

    tok = default_engine.get_tokenizer()
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(40))
    ids = tok.encode(text)[:300]
    assert len(ids) == 300
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = default_engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]

    engine = Engine(dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
                    max_model_len=1024, precompile=False)
    plans = _record_plans(engine)
    got = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]

    chunks = [c for plan in plans for c in plan]
    prefill = chunks[:5]
    assert [(start, n) for _, start, n, _ in prefill] == [(0, 64), (64, 64), (128, 64), (192, 64), (256, 44)]
    assert [samples for *_, samples in prefill] == [False, False, False, False, True]  # only the last chunk samples
    assert all(n == 1 and samples for _, _, n, samples in chunks[5:])
    assert all(shape.tokens <= 64 for shape in engine.step_shapes())  # no step ever exceeds the budget
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.finish_reason == "length"
    _assert_no_leak(engine)


def test_preemption_under_a_small_pool_gives_the_same_greedy_text(small_engine, prompts, reference):
    before = small_engine.scheduler.num_preemptions
    outs = small_engine.generate(prompts, GREEDY, use_tqdm=False)
    assert small_engine.scheduler.num_preemptions > before, "the pool was expected to force preemptions"
    assert [o.outputs[0].token_ids for o in outs] == reference
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == NUM_OUT
    _assert_no_leak(small_engine)


def test_no_page_leak_after_finished_aborted_and_preempted_requests(small_engine, prompts, reference):
    engine = small_engine
    scheduler = engine.scheduler
    before = scheduler.num_preemptions
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"leak-{i}", prompt, short if i == 1 else GREEDY)
    members = {rid: reqs[0] for rid, reqs in engine._request_groups.items() if rid.startswith("leak-")}
    finished: dict[str, list[int]] = {}

    def run_step():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        engine.pages.check_integrity()
        held = [p for r in scheduler.running for p in r.page_table]
        assert len(held) == len(set(held)) == engine.pages.num_usable_pages - engine.pages.num_free_pages

    for _ in range(200):  # decode until a preempted request sits in the queue
        run_step()
        if scheduler.num_preemptions > before and scheduler.waiting:
            break
    assert scheduler.num_preemptions > before
    assert finished.get("leak-1") == reference[1][:3]  # the short one finished normally
    victim = scheduler.waiting[0]
    assert victim.num_preemptions > 0 and victim.output_token_ids
    running = scheduler.running[0]
    engine.abort_request([victim.request_id, running.request_id, "no-such-request"])
    assert victim.status is running.status is RequestStatus.FINISHED_ABORTED
    assert victim.page_table == [] and running.page_table == []

    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        run_step()
    _assert_no_leak(engine)
    aborted = {victim.request_id, running.request_id}
    for rid, request in members.items():
        i = int(rid.split("-")[1])
        if rid in aborted:
            assert request.status.finish_reason == "abort"
            assert rid not in finished
        else:
            assert request.status.finish_reason == "length"
            assert finished[rid] == reference[i][: len(finished[rid])]
            assert len(finished[rid]) == (3 if i == 1 else NUM_OUT)
    assert not engine._request_groups  # every prompt's bookkeeping is gone


def test_n_completions_share_the_prompt_pages(default_engine):
    """n > 1 members fork the full prompt pages their first sibling computed instead of recomputing them."""
    engine = default_engine
    ids = engine.get_tokenizer().encode("The history of the printing press begins in the fifteenth century, " * 3)
    page = engine.config.page_size
    assert len(ids) > 2 * page
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = engine.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    forked = engine.generate([{"prompt_token_ids": ids}], SamplingParams(n=3, temperature=0, max_tokens=6,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    assert forked.num_cached_tokens == len(ids) - 1  # the first run's pages, its partial last one included
    assert [c.token_ids for c in forked.outputs] == [alone] * 3
    seeded = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
    first = engine.generate([{"prompt_token_ids": ids}], seeded, use_tqdm=False)[0]
    again = engine.generate([{"prompt_token_ids": ids}], seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # members draw independently
    engine.pages.check_integrity()
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages


def test_grammar_constrained_requests_survive_preemption(small_engine, default_engine, prompts):
    """A preempted request recomputes its tokens; its grammar state, fed each output token once, goes on where it
    was: the same constrained greedy text as without preemption, and every character in the grammar."""
    import re

    from jvllm import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_OUT, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    expected = [o.outputs[0].text for o in default_engine.generate(prompts, params, use_tqdm=False)]
    before = small_engine.scheduler.num_preemptions
    outs = small_engine.generate(prompts, params, use_tqdm=False)
    assert small_engine.scheduler.num_preemptions > before, "the pool was expected to force preemptions"
    assert [o.outputs[0].text for o in outs] == expected
    assert all(re.fullmatch("[a-z ]+", text) and len(o.outputs[0].token_ids) == NUM_OUT
               for text, o in zip(expected, outs))
    _assert_no_leak(small_engine)
