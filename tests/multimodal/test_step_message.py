"""The step message carries a step's encoder work: the engine plans which images to encode and at which buffer rows
(its EncoderCache), the worker's EncoderRunner runs from those plain values only, and a runner fed nothing but the
pickled StepCalls (what the other hosts receive) ends with the same encoder buffer and KV pool."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("torch")

from jvllm import Engine, SamplingParams  # noqa: E402
from jvllm.core.encoder_cache import EncoderCache  # noqa: E402
from jvllm.engine.step_plan import plan_chunks  # noqa: E402
from jvllm.worker.step_call import StepCall  # noqa: E402
from jvllm.worker.step_plan import EncodeItem  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(folder) -> Engine:
    # small steps: prompts are prefilled in chunks, some of which end inside an image
    return Engine(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256, precompile=False,
                  max_num_seqs=4, max_num_batched_tokens=24, async_scheduling=False, attention_backend="xla")


@pytest.fixture(scope="module")
def engines(tiny_llava) -> tuple[Engine, Engine]:
    """(rank 0's engine, an engine whose runner only replays rank 0's messages)."""
    return _engine(tiny_llava[0]), _engine(tiny_llava[0])


class RecordingChannel:
    """Stands in for rank 0's StepChannel: keeps every message, pickled as the channel sends it."""

    is_leader, closed = True, False

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, call: StepCall) -> None:
        self.sent.append(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))


def test_plans_carry_each_new_image_with_its_buffer_rows(engines, images):
    engine = engines[0]
    engine.add_request("plan", {"prompt": "<image> and <image>?", "multi_modal_data": {"image": images[:2]}},
                       SamplingParams(max_tokens=1))
    chunks = engine.scheduler.schedule()
    try:
        plan, = plan_chunks(chunks, engine.encoder_cache, engine.runner.mrope)
        items = chunks[0].request.mm_items
        assert [item.key for item in plan.encode] == [item.hash for item in items[:1]]  # the second waits its turn
        encoded, = plan.encode
        assert isinstance(encoded, EncodeItem) and encoded.rows.dtype == np.int32
        assert encoded.rows.tolist() == engine.encoder_cache.item_rows(items[0].hash)
        np.testing.assert_array_equal(encoded.data, items[0].data)
        calls = engine.runner.encoder.calls(plan.encode)
        assert [(c.shape.tokens, c.rows.tolist()) for c in calls] == [(16, encoded.rows.tolist())]
    finally:
        engine.abort_request("plan")
    # the worker keeps no reference to the scheduler's map of the buffer
    for holder in (engine.runner, engine.runner.encoder):
        assert not any(isinstance(value, EncoderCache) for value in vars(holder).values())


def test_a_runner_fed_only_the_messages_ends_in_the_same_state(engines, images):
    leader, follower = engines
    channel = leader.runner.channel = RecordingChannel()
    try:
        prompts = [{"prompt": "Compare <image> with <image>, then say which is brighter.",
                    "multi_modal_data": {"image": images[2:4]}},
                   {"prompt": "USER: <image>\nWhat is it? ASSISTANT:", "multi_modal_data": {"image": images[3:4]}},
                   "A prompt without any image at all."]
        outputs = leader.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        leader.runner.channel = None
    assert all(len(out.outputs[0].token_ids) == 6 for out in outputs)
    calls = [pickle.loads(message) for message in channel.sent]
    encoder_steps = [encoder_call for call in calls for encoder_call in call.encode]
    assert len(encoder_steps) == 2  # the two new images, once each: the repeated one comes from the cache
    for call in calls:
        follower.runner.run_call(call)
    np.testing.assert_array_equal(np.asarray(follower.runner.encoder.buffer), np.asarray(leader.runner.encoder.buffer))
    assert np.any(np.asarray(leader.runner.encoder.buffer)[16:])  # rows past the reserved block hold features
    for (k_leader, v_leader), (k_follower, v_follower) in zip(leader.runner.kv_cache, follower.runner.kv_cache):
        np.testing.assert_array_equal(np.asarray(k_follower), np.asarray(k_leader))
        np.testing.assert_array_equal(np.asarray(v_follower), np.asarray(v_leader))
