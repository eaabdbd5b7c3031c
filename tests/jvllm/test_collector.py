"""The garbage collector around the engine: no automatic collection while an engine starts, the start-up heap
frozen only in a process jvllm owns (its command line), never in a library caller's; young collections spaced out
while the engine steps, which is safe because its steps leave no cyclic garbage."""
from __future__ import annotations

import gc
import pathlib
import subprocess
import sys
import tomllib

import pytest

from jvllm.collector import STEPPING_YOUNG_THRESHOLD, collector_paused, young_collections_spaced

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_llama(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def test_the_collector_is_paused_inside_and_restored_after_even_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("start-up failed")
    assert gc.isenabled()
    gc.disable()  # a caller that disabled it keeps it disabled
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_library_engine_starts_with_one_full_collection_leaves_its_heap_old_and_freezes_nothing(tiny_llama,
                                                                                                   monkeypatch):
    from jvllm import LLM
    from jvllm.worker import executable_memo

    # the executable memo's own full collection, once the process holds half its memory maps, is kept out: a test
    # process that has built many engines before this one reaches it
    monkeypatch.setattr(executable_memo, "maps_in_use", lambda: 0)
    collections: list[int] = []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.callbacks.append(on_collection)
    try:
        engine = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256,
                     max_num_seqs=4, max_num_batched_tokens=64)
        young, old = len(gc.get_objects(0)) + len(gc.get_objects(1)), len(gc.get_objects(2))
    finally:
        gc.callbacks.remove(on_collection)
    assert engine.generate("Hi", use_tqdm=False)[0].outputs[0].token_ids  # the engine works
    # Without the pause, tracing and compiling trigger hundreds; with it, only the one full collection on the way
    # out, which leaves the start-up heap in the oldest generation: the first collections of the caller's
    # requests walk only what those requests made.
    assert collections == [2]
    assert young < old / 20, (young, old)
    assert gc.isenabled()
    # a dropped engine must stay collectable: nothing frozen (the count drops as frozen objects die by refcount)
    assert gc.get_freeze_count() <= frozen_before


def test_a_library_engine_start_frees_an_engine_the_caller_dropped_in_a_cycle(tiny_llama):
    import weakref

    from jvllm import LLM

    settings = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, max_num_seqs=4,
                    max_num_batched_tokens=64, precompile=False)
    dropped = LLM(tiny_llama, **settings)
    dropped.itself = dropped  # a cycle: only the cyclic collector can free it (and its KV pool)
    gone = weakref.ref(dropped)
    del dropped
    LLM(tiny_llama, **settings)
    assert gone() is None


def test_the_jvllm_command_freezes_the_heap_its_engine_built(tiny_llama):
    """`jvllm` runs `entrypoints.command.run`, which freezes what its imports built and declares the process
    jvllm's; its engine's start-up heap is then out of the collector's walks too (counts read at exit)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["jvllm"] == "entrypoints.command:run"
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count(), 'enabled', gc.isenabled()))\n"
            "from entrypoints.command import run\n"
            f"sys.argv = ['jvllm', 'generate', 'Hi', '--model', {tiny_llama!r}, '--max-tokens', '2', "
            "'--kv-cache-memory-bytes', '16M', '--max-model-len', '256', '--dtype', 'float32']\n"
            "sys.exit(run())\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    frozen, enabled = run.stdout.split("frozen ")[-1].split()[0::2]
    assert int(frozen) > 100_000  # jax, transformers, the model and its executables
    assert enabled == "True"


@pytest.fixture
def default_threshold(monkeypatch):
    """Python's default threshold, and no engine stepping (a session's live server may be, in this process)."""
    import jvllm.collector

    monkeypatch.setattr(jvllm.collector, "_stepping_depth", 0)
    monkeypatch.setattr(jvllm.collector, "_saved_threshold", None)
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_young_collections_are_spaced_inside_and_the_threshold_restored_after_even_on_error(default_threshold):
    with pytest.raises(RuntimeError):
        with young_collections_spaced():
            assert gc.get_threshold() == (STEPPING_YOUNG_THRESHOLD, 10, 10)
            with young_collections_spaced():  # nested: the outer exit restores
                pass
            assert gc.get_threshold() == (STEPPING_YOUNG_THRESHOLD, 10, 10)
            raise RuntimeError("a step failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_caller_s_own_threshold_is_neither_lowered_nor_overwritten(default_threshold):
    gc.set_threshold(0, 10, 10)  # automatic collection off
    with young_collections_spaced():
        assert gc.get_threshold() == (0, 10, 10)
    gc.set_threshold(700, 10, 10)
    with young_collections_spaced():
        gc.set_threshold(1234, 5, 5)  # changed by the caller meanwhile
    assert gc.get_threshold() == (1234, 5, 5)


def test_generate_steps_with_spaced_young_collections_and_leaves_no_cyclic_garbage(tiny_llama, default_threshold):
    """The raised threshold holds while the engine steps; the steps (plain, seeded sampling with logprobs, n = 2,
    stop strings, look-ahead steps) leave nothing for the cyclic collector, so collecting less often keeps
    nothing alive."""
    from jvllm import LLM, SamplingParams

    engine = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, max_num_seqs=8,
                 max_num_batched_tokens=64)
    thresholds: list[tuple[int, ...]] = []
    step = engine._step

    def recording_step(*args, **kwargs):
        thresholds.append(gc.get_threshold())
        return step(*args, **kwargs)

    prompts = ["Hi", "The capital of France is", "1, 2, 3,", "A long time ago " * 8]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=20,
                                                                           logprobs=2, n=2),
              SamplingParams(temperature=0, max_tokens=30, stop=[" the"]), SamplingParams(max_tokens=16, seed=1)]
    engine.generate(prompts, params, use_tqdm=False)  # first calls fill caches
    engine._step = recording_step
    gc.collect()
    gc.disable()
    try:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        cyclic_garbage = gc.collect()
    finally:
        gc.enable()
    assert all(output.finished for output in outputs)
    assert thresholds and set(thresholds) == {(STEPPING_YOUNG_THRESHOLD, 10, 10)}
    assert gc.get_threshold() == (700, 10, 10)
    assert cyclic_garbage == 0


def test_an_async_engine_steps_with_spaced_young_collections_until_it_closes(tiny_llama, default_threshold):
    import time

    from jvllm import LLM
    from jvllm.engine.async_engine import AsyncEngine

    engine = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=64, precompile=False)
    wrapper = AsyncEngine(engine)
    try:
        deadline = time.monotonic() + 30
        while gc.get_threshold()[0] != STEPPING_YOUNG_THRESHOLD and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread enters the context as it starts
        assert gc.get_threshold() == (STEPPING_YOUNG_THRESHOLD, 10, 10)
    finally:
        wrapper.close()
    assert gc.get_threshold() == (700, 10, 10)
