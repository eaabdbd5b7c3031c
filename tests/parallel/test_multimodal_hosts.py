"""Vision-language models on several hosts: two processes of 2 virtual CPU devices form one tp=4 mesh; rank 0
schedules and sends each step's StepCall, encoder steps included, and rank 1 runs the same encoder and model steps.

* Greedy tokens of prompts with images (several per prompt, one image in two prompts, a text-only prompt, prefill
  chunks that end inside an image) equal a single process's tp=1 engine's.
* Both ranks' encoder buffers end bit-identical: every rank ran the same encoder steps from the same messages.
* The language model loads sharded from the checkpoint's own tensor names; the vision tower is replicated.

Qwen2-VL (packed patches, M-RoPE) runs here; LLaVA's batched encoder takes the same message in one process
(tests/multimodal/test_step_message.py), where a runner fed only the pickled StepCalls ends like rank 0.
"""
from __future__ import annotations

import json
import sys

import pytest

from tests.parallel.processes import (UNEXPECTED_COMPILE, WORKER, free_port, run_together, run_worker,
                                      worker_result)

MAX_TOKENS = 8
# Small steps: prompts are prefilled in chunks of 24 tokens, so chunks end inside images and some steps encode
# images that a later step reads.
ENGINE = {"max_num_batched_tokens": 24, "max_num_seqs": 4}


def _qwen2_vl(folder) -> tuple[str, list]:
    from tests.multimodal.qwen2_vl_helpers import PLACEHOLDER, build_qwen2_vl, qwen2_vl_tokenizer

    build_qwen2_vl(folder, qwen2_vl_tokenizer())
    # the processor resizes each image to 2 x 2 .. 4 x 4 tokens of 28 x 28 pixels
    return PLACEHOLDER, [[0, 56, 112], [1, 90, 60], [2, 112, 112]]


@pytest.fixture(scope="module")
def vision_language(tmp_path_factory) -> tuple[str, list]:
    """(folder of a tiny random vision-language checkpoint saved by transformers, its mm_prompts)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("qwen2_vl")
    placeholder, images = _qwen2_vl(folder)
    first, second, third = images
    prompts = [[f"Look: {placeholder} and {placeholder}, then tell me what differs between them", [first, second]],
               [f"{placeholder} What is this?", [third]],
               ["A prompt without any image at all, only words", []],
               [f"Once more {placeholder} the second one", [second]]]
    return str(folder), prompts


def test_two_hosts_run_a_vision_language_model_like_one(vision_language):
    model, prompts = vision_language
    args = {"model": model, "mm_prompts": prompts, "max_tokens": MAX_TOKENS, "engine": ENGINE}
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, str(WORKER), "multihost",
                 json.dumps({**args, "tp": 4, "num_hosts": 2, "rank": rank, "coordinator": coordinator})]
                for rank in (0, 1)]
    reference = run_worker("generate", args, devices=1)
    ranks = run_together(commands, devices=2)
    leader, follower = [worker_result(*r) for r in ranks]
    assert not any(UNEXPECTED_COMPILE in stderr for _, stderr, _ in ranks)  # broadcasts compile at start
    assert (leader["devices"], leader["local_devices"]) == (4, 2)
    assert leader["tokens"] == reference["tokens"]
    assert all(len(tokens) == MAX_TOKENS for tokens in leader["tokens"])
    assert follower["steps_followed"] > 0
    assert leader["encoder_buffer"] is not None and follower["encoder_buffer"] == leader["encoder_buffer"]
