"""Steps dispatched from a thread of their own (JVLLM_DISPATCH_THREAD=1): the same outputs as on the engine's thread,
the calls really made on the dispatch thread, a launch's error raised to the caller, no pages left behind."""
from __future__ import annotations

import contextlib
import threading

import pytest

from jvllm import SamplingParams, StructuredOutputsParams
from jvllm.worker.step_launcher import DISPATCH_THREAD_ENV, StepLauncher, dispatch_thread_asked

pytestmark = pytest.mark.slow

PROMPTS = ["Tell me a story about a dragon who lives in a library.", "What is the capital of France?",
           "List three colors:", "Why is the sky blue?", "Write a haiku about the sea.", "Count to ten: one,"]


@contextlib.contextmanager
def _threaded(engine):
    """The shared engine's steps dispatched from a dispatch thread; -> the names of the threads run_call ran on."""
    runner = engine.runner
    plain, run_call = runner._launcher, runner.run_call
    threads: list[str] = []

    def recording(call, *args):
        threads.append(threading.current_thread().name)
        return run_call(call, *args)

    runner._launcher, runner.run_call = StepLauncher(threaded=True), recording
    try:
        yield threads
    finally:
        runner._launcher.close()
        runner._launcher = plain
        del runner.run_call  # the instance attribute: back to the class's method


def _summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in outputs]


def _assert_no_leak(engine) -> None:
    engine.pages.check_integrity()
    assert not engine.has_unfinished_requests() and engine._ahead is None
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages, "KV pages leaked"


def test_only_zero_or_one_is_taken(monkeypatch):
    monkeypatch.delenv(DISPATCH_THREAD_ENV, raising=False)
    assert dispatch_thread_asked() is False
    monkeypatch.setenv(DISPATCH_THREAD_ENV, "1")
    assert dispatch_thread_asked() is True
    monkeypatch.setenv(DISPATCH_THREAD_ENV, "yes")
    with pytest.raises(ValueError, match=DISPATCH_THREAD_ENV):
        dispatch_thread_asked()


def test_the_dispatch_thread_gives_the_same_outputs(default_engine):
    """Uneven prompts and lengths, a stop string, n=2 seeded sampling, and grammar-constrained rows (their
    look-ahead sampler waits for finish_head): every step's calls go through the dispatch thread."""
    engine = default_engine
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 7 * i, logprobs=2) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0.0, max_tokens=40, stop=["."])
    params[2] = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20)
    params[3] = SamplingParams(temperature=0.0, max_tokens=30,
                               structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,60}"))
    params[4] = SamplingParams(temperature=0.0, max_tokens=20,
                               structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    expected = engine.generate(PROMPTS, params, use_tqdm=False)
    with _threaded(engine) as threads:
        got = engine.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert threads and set(threads) == {"jvllm-dispatch_0"}, set(threads)
    _assert_no_leak(engine)


def test_an_error_in_a_launch_reaches_the_caller_and_the_engine_goes_on(default_engine):
    engine = default_engine
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = engine.generate(PROMPTS[:3], params, use_tqdm=False)
    with _threaded(engine):
        calls = {"n": 0}
        run_call = engine.runner.run_call

        def failing(call, *args):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("a launch failed")
            return run_call(call, *args)

        engine.runner.run_call = failing
        with pytest.raises(RuntimeError, match="a launch failed"):
            engine.generate(PROMPTS[:3], params, use_tqdm=False)
        _assert_no_leak(engine)
        engine.runner.run_call = run_call
        again = engine.generate(PROMPTS[:3], params, use_tqdm=False)
    assert _summary(again) == _summary(expected)
