"""`batched_weight_dtype`: a bf16 copy of the weight matrices, used for steps of 2+ token rows."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import Engine, SamplingParams
from jvllm.model_runner import BATCHED_MIN_ROWS

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of", "One, two, three,"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def prompt_logprobs(engine: Engine) -> list[np.ndarray]:
    """Each prompt's own tokens' logprobs (all computed in one multi-row prefill step)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = engine.generate(PROMPTS, params, use_tqdm=False)
    return [np.array([next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]) for out in outputs]


def test_batched_copy_holds_bf16_matrices_and_serves_multi_row_steps(tiny_llama):
    engine = Engine(tiny_llama, max_num_seqs=4, batched_weight_dtype="bfloat16")
    runner = engine.runner
    for full, batched in zip(runner.weights, runner.batched_weights):
        assert batched.shape == full.shape
        assert batched.dtype == (jnp.bfloat16 if full.ndim >= 2 else full.dtype)  # norms stay float32
    assert BATCHED_MIN_ROWS == 2
    assert runner._weights_for(1) is runner.weights  # a 1-row bf16 dot is a slow matrix-vector product
    assert runner._weights_for(BATCHED_MIN_ROWS) is runner.batched_weights


def test_bf16_weights_compute_the_same_model_within_bf16_rounding(tiny_llama):
    """Prompt logprobs from a multi-row prefill: bf16 weight copy vs float32 weights, same random model."""
    exact = prompt_logprobs(Engine(tiny_llama, max_num_seqs=4))
    rounded = prompt_logprobs(Engine(tiny_llama, max_num_seqs=4, batched_weight_dtype="bfloat16"))
    for a, b in zip(exact, rounded):
        assert a.shape == b.shape and len(a) > 3
        np.testing.assert_allclose(b, a, atol=5e-3, rtol=0)  # measured <= 1.3e-3; the values spread ~0.1-0.2
        assert not np.array_equal(a, b)  # the bf16 copy was really used
