"""AsyncEngine: streams match the offline engine; close/cancel/abort free pages; failures reach the caller."""
from __future__ import annotations

import asyncio
import time

import pytest

from jvllm import SamplingParams
from jvllm.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError

GREEDY = SamplingParams(temperature=0, max_tokens=10)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from jvllm import Engine

    return Engine(model=str(tiny_model_factory("llama")), dtype="float32", max_num_seqs=8,
                  kv_cache_memory_bytes=64 << 20, max_model_len=512, precompile=False)


@pytest.fixture
def async_engine(engine):
    """A fresh AsyncEngine over the shared Engine (only one may drive it at a time)."""
    wrapper = AsyncEngine(engine, max_waiting_requests=2)
    yield wrapper
    wrapper.close()
    assert not engine.has_unfinished_requests()
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages
    engine.pages.check_integrity()


def _wait(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.005)
    return predicate()


def _idle(wrapper: AsyncEngine) -> bool:
    pages = wrapper.engine.pages
    return not wrapper._streams and pages.num_free_pages == pages.num_usable_pages


def test_generate_streams_growing_outputs_ending_like_engine_generate(engine, async_engine):
    async_engine.close()  # let the test use the Engine directly for the reference
    prompts = ["The first prompt", "Another, longer prompt about the sea"]
    expected = [o.outputs[0] for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    wrapper = AsyncEngine(engine)

    async def run(prompt: str, request_id: str):
        seen = []
        async for output in wrapper.generate(prompt, GREEDY, request_id):
            seen.append(output)
        return seen

    async def main():  # several requests in one loop, as a server (or a notebook cell with `await`) runs them
        assert asyncio.get_running_loop().is_running()
        return await asyncio.gather(*(run(p, f"r{i}") for i, p in enumerate(prompts)))

    try:
        for seen, want in zip(asyncio.run(main()), expected):
            assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
            lengths = [len(o.outputs[0].token_ids) for o in seen]
            assert lengths == sorted(lengths) and len(seen) > 1
            final = seen[-1].outputs[0]
            assert (final.text, final.token_ids, final.finish_reason) == (want.text, want.token_ids,
                                                                         want.finish_reason)
        # a second event loop (e.g. the next notebook cell run with asyncio.run) works too
        again = asyncio.run(run(prompts[0], "r-again"))
        assert again[-1].outputs[0].text == expected[0].text
    finally:
        wrapper.close()


def test_closing_the_generator_aborts_and_frees_pages(async_engine):
    async def main():
        stream = async_engine.generate("close me early", LONG, "closer")
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    assert _wait(lambda: _idle(async_engine))


def _cancel_after_first_output(async_engine: AsyncEngine, request_id: str, before_cancel=lambda: None) -> None:
    """Consume a long request in a task and cancel that task once the first output arrived."""
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in async_engine.generate("cancel me", LONG, request_id):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        before_cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_cancelling_the_task_aborts_the_request(async_engine):
    _cancel_after_first_output(async_engine, "cancelled")
    assert _wait(lambda: _idle(async_engine))


def test_a_cancelled_stream_is_forgotten_even_when_its_loop_drops_the_confirmation(async_engine, monkeypatch):
    """asyncio.run may close its loop right after a cancel, before the abort's confirmation runs there: the
    engine thread must not leave the stream behind (it would hold the request id forever)."""
    def drop_callbacks():  # as a loop that is closing does
        monkeypatch.setattr(async_engine, "_post", lambda loop, callback, *args: None)

    _cancel_after_first_output(async_engine, "dropped", drop_callbacks)
    assert _wait(lambda: _idle(async_engine), timeout=10.0)


def test_abort_from_outside_ends_the_stream_with_abort(async_engine):
    async def main():
        outputs = []
        async for output in async_engine.generate("abort me", LONG, "victim"):
            outputs.append(output)
            if len(outputs) == 2:
                async_engine.abort("victim")
        return outputs[-1]

    final = asyncio.run(main())
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 400
    assert _wait(lambda: _idle(async_engine))


def test_a_refused_prompt_raises_and_leaves_nothing_behind(async_engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_engine.generate({"prompt_token_ids": [5] * 600}, GREEDY, "too-long"):
                pass

    asyncio.run(main())
    assert _idle(async_engine)


def test_a_full_waiting_queue_raises_queue_full(async_engine, monkeypatch):
    runner = async_engine.engine.runner
    real = runner.collect
    monkeypatch.setattr(runner, "collect", lambda *a, **k: (time.sleep(0.05), real(*a, **k))[1])

    async def main():
        # 8 run, 2 may wait; the rest are refused. All are queued while one slow step is in flight.
        streams = await asyncio.gather(*(async_engine.add_request(f"queue {i}", LONG, f"q{i}") for i in range(12)),
                                       return_exceptions=True)
        refused = [s for s in streams if isinstance(s, QueueFullError)]
        accepted = [s for s in streams if not isinstance(s, BaseException)]
        for stream in accepted:
            stream.close()
        return len(accepted), len(refused)

    accepted, refused = asyncio.run(main())
    assert refused >= 1 and accepted + refused == 12 and accepted >= 10
    assert _wait(lambda: _idle(async_engine))


def test_the_waiting_limit_counts_every_sequence_of_a_request(async_engine, monkeypatch):
    runner = async_engine.engine.runner
    real = runner.collect
    monkeypatch.setattr(runner, "collect", lambda *a, **k: (time.sleep(0.05), real(*a, **k))[1])

    async def main():
        # 8 sequences fill the batch; the waiting queue holds 2 sequences: n=3 does not fit, n=2 does.
        first = await async_engine.add_request("fill", SamplingParams(n=8, temperature=0.8, max_tokens=400,
                                                                      ignore_eos=True), "fill")
        with pytest.raises(QueueFullError, match="3 more asked"):
            await async_engine.add_request("three", SamplingParams(n=3, max_tokens=4), "three")
        fits = await async_engine.add_request("two", SamplingParams(n=2, max_tokens=4), "two")
        for stream in (first, fits):
            stream.close()

    asyncio.run(main())
    assert _wait(lambda: _idle(async_engine))


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(async_engine, monkeypatch):
    runner = async_engine.engine.runner
    real = runner.collect
    state = {"fail": True}

    def flaky(*args, **kwargs):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("transient device error")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "collect", flaky)

    async def collect(prompt: str, request_id: str):
        return [o async for o in async_engine.generate(prompt, GREEDY, request_id)]

    async def main():
        with pytest.raises(EngineStepError, match="transient device error"):
            await collect("unlucky", "unlucky")
        return await collect("lucky", "lucky")

    outputs = asyncio.run(main())
    assert outputs[-1].finished and async_engine.is_running


def test_repeated_failures_kill_the_engine(async_engine, monkeypatch):
    monkeypatch.setattr(async_engine.engine.runner, "collect", lambda *a, **k: (_ for _ in ()).throw(OSError("gone")))

    async def main():
        for i in range(3):
            with pytest.raises(EngineStepError):
                async for _ in async_engine.generate(f"doomed {i}", GREEDY, f"d{i}"):
                    pass
        with pytest.raises(EngineDeadError):
            async for _ in async_engine.generate("after death", GREEDY, "late"):
                pass

    asyncio.run(main())
    assert not async_engine.is_running and isinstance(async_engine.dead_error, OSError)


def test_shutdown_fails_open_streams_and_refuses_new_ones(async_engine):
    async def main():
        stream = await async_engine.add_request("still running", LONG, "open")
        await stream.__anext__()
        await async_engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("too late", GREEDY)

    asyncio.run(main())


def test_stats_and_observers_see_every_step(async_engine):
    seen = []
    async_engine.observers.append(seen.append)

    async def main():
        return [o async for o in async_engine.generate("observe me", GREEDY, "observed")]

    outputs = asyncio.run(main())
    seen_ids = [o.outputs[0].token_ids for o in seen]
    assert [len(ids) for ids in seen_ids] == list(range(1, len(seen_ids) + 1))  # every step, one token each
    assert seen[-1].finished and seen_ids[-1] == outputs[-1].outputs[0].token_ids
    # a reader that falls behind gets the latest output (streams coalesce): a subset of what observers saw
    assert all(o.outputs[0].token_ids in seen_ids for o in outputs)
    # stats are published right after the step whose outputs were just delivered
    assert _wait(lambda: async_engine.stats.num_running == 0)
    stats = async_engine.stats
    assert stats.num_steps >= len(outputs) and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def _record_first_steps(engine, monkeypatch) -> list[tuple[float, int]]:
    """(time, requests waiting) at the start of every step of `engine`."""
    starts: list[tuple[float, int]] = []
    step = engine.step

    def recording_step():
        starts.append((time.monotonic(), len(engine.scheduler.waiting)))
        return step()

    monkeypatch.setattr(engine, "step", recording_step)
    return starts


def test_the_engine_asks_the_wrapper_for_queued_requests_until_it_closes(engine):
    """The Engine's arrival check (see Engine._no_arrival) is the wrapper's command queue: true while an add waits
    to be applied, not for an abort; the wrapper takes it back when it closes."""
    from jvllm.engine.commands import Abort, Add

    wrapper = AsyncEngine(engine)
    try:
        queue = wrapper._commands
        assert engine.arrivals == queue.has_adds and not queue.has_adds()
        with queue._cv:  # as a caller's submit leaves it, without waking the engine thread to apply it
            queue._commands.append(Abort("nobody"))
            assert not queue.has_adds()
            queue._commands.append(Add("r", "hi", GREEDY, 0.0, None, None))
            assert queue.has_adds()
            queue._commands.clear()
    finally:
        wrapper.close()
    assert engine.arrivals is None


def test_a_burst_of_arrivals_into_an_idle_engine_shares_its_first_step(engine, monkeypatch):
    starts = _record_first_steps(engine, monkeypatch)
    wrapper = AsyncEngine(engine, burst_gap_s=0.05, max_burst_wait_s=2.0)  # roomy: CI machines stall

    async def main():
        async def one(i: int):
            await asyncio.sleep(0.005 * i)  # staggered arrivals, each well within the gap
            return [o async for o in wrapper.generate(f"burst {i}", GREEDY, f"burst-{i}")]

        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        outputs = asyncio.run(main())
    finally:
        wrapper.close()
    assert all(o[-1].finished for o in outputs)
    assert starts[0][1] == 6  # all six prefilled together, none alone ahead of the rest


def test_a_lone_request_waits_one_gap_and_the_wait_is_capped(engine, monkeypatch):
    starts = _record_first_steps(engine, monkeypatch)
    wrapper = AsyncEngine(engine, burst_gap_s=0.05, max_burst_wait_s=0.3)

    async def lone():
        added = time.monotonic()
        await wrapper.add_request("alone", GREEDY, "lone")
        return added

    async def trickle():  # a new request every 20 ms for 1 s: the first step must not wait for the end
        added = time.monotonic()
        adds = []
        for i in range(50):
            adds.append(asyncio.ensure_future(wrapper.add_request(f"trickle {i}", GREEDY, f"trickle-{i}")))
            await asyncio.sleep(0.02)
        for stream in await asyncio.gather(*adds):
            async for _ in stream:
                pass
        return added

    try:
        added = asyncio.run(lone())
        assert _wait(lambda: bool(starts)) and _idle_after(wrapper)
        assert starts[0][0] - added < 0.3  # the gap (50 ms) plus scheduling noise, well under a cap's worth
        starts.clear()
        added = asyncio.run(trickle())
        assert starts[0][0] - added < 0.3 + 0.2  # the cap, not the whole second of arrivals
    finally:
        wrapper.close()


def _idle_after(wrapper: AsyncEngine) -> bool:
    return _wait(lambda: not wrapper.engine.has_unfinished_requests())
