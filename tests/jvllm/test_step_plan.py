"""The step contract: scheduled chunks become plain ChunkPlans the worker reads without the scheduler's objects."""
from __future__ import annotations

from jvllm.core.request import Request
from jvllm.core.scheduler import ScheduledChunk
from jvllm.engine.step_plan import plan_chunks
from jvllm.sampling_params import SamplingParams
from jvllm.worker.step_plan import ChunkPlan


def request(prompt: list[int], **params) -> Request:
    made = Request("r", None, prompt, SamplingParams(**params), seed=3, max_total_tokens=64, eos_token_ids=(2,))
    made.page_table = [5, 9]
    return made


def test_a_prompt_chunk_carries_its_ids_pages_and_prompt_logprob_targets():
    r = request([11, 12, 13, 14, 15], prompt_logprobs=1, logprobs=2, min_tokens=1)
    r.num_computed_tokens = 1
    first, = plan_chunks([ScheduledChunk(r, 3)])  # tokens 12, 13, 14: not the prompt's last, so no sampling
    assert isinstance(first, ChunkPlan) and first.request_id == "r"
    assert first.row.token_ids == [12, 13, 14] and first.row.start == 1 and first.row.page_table == [5, 9]
    assert not first.samples and first.wants_logprobs and not first.constrained
    assert first.prompt_targets == [13, 14, 15] and first.num_prompt_targets == 3
    r.num_computed_tokens = 4
    last, = plan_chunks([ScheduledChunk(r, 1)])  # the prompt's last token: it samples, and has no next prompt token
    assert last.samples and last.prompt_targets is None
    assert list(last.spec.blocked_ids) == [2] and last.spec.position == 5 and last.spec.seed == 3  # min_tokens


def test_a_look_ahead_chunk_leaves_its_input_to_the_device():
    r = request([11, 12], max_tokens=8)
    r.output_token_ids.append(40)
    r.num_computed_tokens = 3  # the token being sampled on the device is the next input
    plan, = plan_chunks([ScheduledChunk(r, 1, lookahead=True)])
    assert plan.row.token_ids == [0] and plan.row.start == 3 and plan.samples
    assert plan.spec.position == 4 and plan.prompt_targets is None  # it samples the token after the pending one
