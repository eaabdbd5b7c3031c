"""Async scheduling on the real model: the same outputs as synchronous steps, look-ahead steps really run (and
give way to a request queued meanwhile), aborts and early stops while a look-ahead step is in flight leave no pages
behind."""
from __future__ import annotations

import contextlib

import pytest

from jvllm import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Tell me a story about a dragon who lives in a library.", "What is the capital of France?",
           "List three colors:", "Why is the sky blue?", "Write a haiku about the sea."]


@contextlib.contextmanager
def _mode(engine, async_scheduling: bool):
    """Switch the shared engine's scheduling mode; count the look-ahead dispatches made meanwhile."""
    before = engine.async_scheduling
    dispatch = engine.runner.dispatch
    lookaheads = []

    def counting(chunks, source=None, gate=None):
        groups = dispatch(chunks, source, gate)
        if source is not None and groups is not None:  # None: its gate held it back
            lookaheads.append(len(chunks))
        return groups

    engine.async_scheduling = async_scheduling
    engine.runner.dispatch = counting
    try:
        yield lookaheads
    finally:
        engine.async_scheduling = before
        del engine.runner.dispatch  # the instance attribute: back to the class's method


def _summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] for out in outputs]


def _logprobs(outputs) -> list:
    """Flat (token id, logprob) pairs. A look-ahead step may pad to a different row count than the synchronous
    one, so float32 logits differ in the last bits: compared to 1e-4."""
    return [(t, lp.logprob) for out in outputs for c in out.outputs for entry in (c.logprobs or [])
            for t, lp in entry.items()]


def _assert_no_leak(engine) -> None:
    engine.pages.check_integrity()
    assert not engine.has_unfinished_requests() and engine._ahead is None
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages, "KV pages leaked"


def test_async_and_synchronous_steps_give_the_same_outputs(default_engine):
    engine = default_engine
    assert engine.async_scheduling, "async scheduling is the default on one device"
    params = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["."]),  # stops early: its look-ahead row is dropped
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, logprobs=2),  # EOS blocked for 12 tokens
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
    ]
    with _mode(engine, False) as sync_lookaheads:
        sync_outputs = engine.generate(PROMPTS, params, use_tqdm=False)
    with _mode(engine, True) as lookaheads:
        async_outputs = engine.generate(PROMPTS, params, use_tqdm=False)
    expected, got = _summary(sync_outputs), _summary(async_outputs)
    assert got == expected
    expected_logprobs, got_logprobs = _logprobs(sync_outputs), _logprobs(async_outputs)
    assert len(expected_logprobs) == 2 * 20
    assert [t for t, _ in got_logprobs] == [t for t, _ in expected_logprobs]
    assert [lp for _, lp in got_logprobs] == pytest.approx([lp for _, lp in expected_logprobs], abs=1e-4)
    assert sync_lookaheads == []
    assert len(lookaheads) > 20, "most decode steps should have been dispatched ahead"
    assert expected[1][0][2] == "stop" and len(expected[1][0][0]) < 30  # stopped early (a stop string or EOS)
    _assert_no_leak(engine)


def test_a_queued_arrival_holds_back_the_lookahead_step_with_the_same_outputs(default_engine, monkeypatch):
    """A front end's arrival check (AsyncEngine's) is asked once the device has run the current step: when it says
    a request is queued, the prepared look-ahead step does not start (the next step is scheduled with the
    newcomer); the pages reserved for its tokens serve them in that next step. Same outputs, no page left behind."""
    engine = default_engine
    # True on a CPU; on a GPU look-ahead steps are queued at once, arrivals or not. The gate itself works anywhere.
    monkeypatch.setattr(type(engine.runner), "dispatch_keeps_up", property(lambda runner: True))
    checks: list[bool] = []

    def arrivals() -> bool:  # every other check finds a request queued
        checks.append(len(checks) % 2 == 0)
        return checks[-1]

    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, stop=["."]),
              SamplingParams(temperature=0.9, seed=5, max_tokens=28, ignore_eos=True)]
    with _mode(engine, False):
        expected = _summary(engine.generate(PROMPTS[:3], params, use_tqdm=False))
    engine.arrivals = arrivals
    try:
        with _mode(engine, True) as lookaheads:
            got = _summary(engine.generate(PROMPTS[:3], params, use_tqdm=False))
    finally:
        engine.arrivals = None
    assert got == expected
    assert len(checks) > 20
    assert len(lookaheads) == checks.count(False), "a look-ahead step starts exactly when no arrival was found"
    _assert_no_leak(engine)


def test_penalties_run_synchronously_with_the_same_outputs(default_engine):
    engine = default_engine
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)]
    with _mode(engine, False):
        expected = _summary(engine.generate(PROMPTS[:2], params, use_tqdm=False))
    with _mode(engine, True) as lookaheads:
        got = _summary(engine.generate(PROMPTS[:2], params, use_tqdm=False))
    assert got == expected
    assert lookaheads == []  # a penalized request needs its last token on the host every step
    _assert_no_leak(engine)


def test_constrained_requests_keep_async_scheduling_with_the_same_outputs(default_engine):
    """A look-ahead step of grammar-constrained rows samples once the previous step's tokens have advanced
    their grammars: the same outputs as synchronous steps, and the steps still go ahead."""
    from jvllm import StructuredOutputsParams

    engine = default_engine
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json={
                  "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                  "required": ["name"]})),
              SamplingParams(temperature=0.9, seed=4, max_tokens=30, stop=[" sea"],
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,80}")),
              SamplingParams(temperature=0.0, max_tokens=30),  # unconstrained, in the same batch
              SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))]
    with _mode(engine, False):
        expected = _summary(engine.generate(PROMPTS[:4], params, use_tqdm=False))
    with _mode(engine, True) as lookaheads:
        got = _summary(engine.generate(PROMPTS[:4], params, use_tqdm=False))
    assert got == expected
    assert len(lookaheads) > 10, "constrained batches should still be dispatched ahead"
    assert expected[3][0][1] in ("red", "green", "blue") and expected[3][1][1] in ("red", "green", "blue")
    _assert_no_leak(engine)


def test_abort_while_a_lookahead_step_is_in_flight(default_engine):
    engine = default_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with _mode(engine, False):
        reference = [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:3], greedy, use_tqdm=False)]
    with _mode(engine, True) as lookaheads:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"ahead-{i}", prompt, greedy)
        seen: dict[str, list[int]] = {}
        for _ in range(6):
            for out in engine.step():
                seen[out.request_id] = out.outputs[0].token_ids
        assert engine._ahead is not None and lookaheads, "a look-ahead step should be in flight"
        aborted = engine._request_groups["ahead-1"][0]
        engine.abort_request("ahead-1")
        assert aborted.page_table == []
        frozen = list(seen["ahead-1"])
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = out.outputs[0].token_ids
    assert seen["ahead-1"] == frozen == reference[1][:len(frozen)]  # no output after the abort
    assert aborted.output_token_ids == frozen
    assert seen["ahead-0"] == reference[0] and seen["ahead-2"] == reference[2]
    _assert_no_leak(engine)
