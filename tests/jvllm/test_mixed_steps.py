"""Decode rows and prefill chunks in one ragged step (the cpu backend), when the cost rule says it is cheaper."""
from __future__ import annotations

import pytest

from jvllm import Engine, SamplingParams
from jvllm.worker.step_shapes import STEP_FLOOR_TOKENS, ShapeSet


@pytest.mark.parametrize("decode_rows,prefill_tokens,mixed", [
    (63, 40, True),  # 103 tokens fit a 128-token step; separate: a 64-row decode step and a 64-token prefill
    (1, 40, True),  # one row rides along in the prefill's padding
    (63, 600, True),  # 663 fit the 1024-token step the prefill takes anyway
    (63, 1000, False),  # 1063 would need a 2048-token step
    (63, 10, False),  # a 128-token step against two floor-cost steps
    (32, 100, False),
    (64, 2000, False),  # more than max_num_batched_tokens together
])
def test_cost_rule(decode_rows, prefill_tokens, mixed):
    assert ShapeSet(64, 2048).mixed_is_cheaper(decode_rows, prefill_tokens) is mixed


def test_floor_is_a_prefill_bucket_or_less():
    assert STEP_FLOOR_TOKENS <= 64


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> Engine:
    return Engine(str(tiny_model_factory("llama")), dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=32 << 20,
                  max_model_len=256, precompile=False)


def _staggered_generate(engine: Engine) -> tuple[list[list[int]], list[tuple[str, int, int]]]:
    """Requests joining while others decode; -> each request's tokens and, for every step, (kind, one-token rows,
    longer rows)."""
    steps = []
    run_call = engine.runner.run_call

    def recording(call, *args, **kwargs):
        q_lens = call.metadata.q_lens
        steps.append((call.shape.kind, int((q_lens == 1).sum()), int((q_lens > 1).sum())))
        return run_call(call, *args, **kwargs)

    engine.runner.run_call = recording
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ids = [[(7 * i + 3 * j) % 200 + 5 for j in range(length)] for i, length in enumerate([9, 30, 5, 17, 41])]
        for i, prompt in enumerate(ids):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
            for _ in range(3):  # a few decode steps before the next request arrives
                engine.step()
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    finally:
        engine.runner.run_call = run_call
    return [outputs[str(i)] for i in range(len(ids))], steps


def test_mixed_steps_give_the_tokens_of_separate_steps(engine, monkeypatch):
    assert engine.runner.backend.name == "cpu" and engine.runner.backend.mixes_decode_rows
    mixed_tokens, mixed_steps = _staggered_generate(engine)
    # prompts are 5+ tokens, so a prefill step with one-token rows carried decode rows
    assert any(kind == "prefill" and ones and longer for kind, ones, longer in mixed_steps)
    monkeypatch.setattr(ShapeSet, "mixed_is_cheaper", lambda *args: False)
    separate_tokens, separate_steps = _staggered_generate(engine)
    assert not any(kind == "prefill" and ones for kind, ones, _ in separate_steps)
    assert len(separate_steps) > len(mixed_steps)
    assert mixed_tokens == separate_tokens
