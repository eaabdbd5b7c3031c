"""The engine on the `pallas` backend: interpret mode on CPU gives the `xla` backend's greedy tokens on the default
model (whole prompts and chunked prefill), through both kinds of step shape. The CUDA lowering of the engine's
step pieces: test_pallas_engine_lowering.py."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm import Engine, SamplingParams
from jvllm.worker.step_shapes import StepShape

# SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on CPU -> 16 tokens of KV per page take this many bytes
PAGE_BYTES_F32 = 2 * 30 * 3 * 64 * 4 * 16

PROMPTS = [
    "Hi",  # one token: its prompt step is a decode-kernel step at kv_len 1
    "The capital of France is",
    "Write a short poem about the sea and the sky, with rhymes, in three lines please.",  # > one page
    "A list of the planets of the solar system, ordered by their distance from the sun, with one fact "
    "about each: Mercury is the closest planet to the sun and",  # > two pages
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def pallas_engine(**overrides) -> Engine:
    """The default model on the pallas backend with a pool just big enough for PROMPTS (interpret mode costs
    grow with the pool). Each step shape compiles when first run (interpret-mode kernels make every shape
    slow to compile)."""
    settings = dict(attention_backend="pallas", dtype="float32", kv_cache_memory_bytes=16 * PAGE_BYTES_F32, max_model_len=64,
                    max_num_seqs=4, precompile=False)
    settings.update(overrides)
    engine = Engine(**settings)
    assert engine.runner.backend.name == "pallas" and engine.runner.backend.step_donates_pool
    return engine


def record_shapes(engine: Engine) -> list[StepShape]:
    """-> the list the shape of every step the engine runs from now on is appended to."""
    runner, ran = engine.runner, []
    run_call = runner.run_call

    def recording(call, *args, **kwargs):
        ran.append(call.shape)
        return run_call(call, *args, **kwargs)

    runner.run_call = recording
    return ran


def assert_same_generations(got, expected) -> None:
    for out, ref in zip(got, expected, strict=True):
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, out.prompt
        # the sampled token's logprob and the top-2 candidates come from the same logits, up to f32 rounding
        np.testing.assert_allclose(out.outputs[0].cumulative_logprob, ref.outputs[0].cumulative_logprob,
                                   rtol=1e-4, atol=1e-4)
        for step, ref_step in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert step.keys() == ref_step.keys()
            for token_id, entry in step.items():
                np.testing.assert_allclose(entry.logprob, ref_step[token_id].logprob, rtol=1e-4, atol=1e-4)


@pytest.fixture
def interpret_default(monkeypatch):
    """Kernels run as the backend picks by default: interpret mode on CPU, compiled on a GPU."""
    monkeypatch.delenv("JVLLM_PALLAS_INTERPRET", raising=False)


@pytest.mark.slow
def test_pallas_engine_matches_xla_greedy_tokens(default_engine, interpret_default):
    engine = pallas_engine()
    lengths = [len(engine.tokenizer.encode(p)) for p in PROMPTS]
    assert min(lengths) == 1 and max(lengths) > 2 * engine.config.page_size
    ran = record_shapes(engine)
    got = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = default_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_generations(got, expected)
    assert set(ran) <= set(engine.step_shapes())
    # the three longer prompts in one prefill step (the one-token prompt in a decode step), then decode steps
    prefills = [shape for shape in ran if shape.kind == "prefill"]
    assert len(prefills) == 1 and prefills[0].tokens >= sum(lengths) - 1
    assert {shape.kind for shape in ran} == {"decode", "prefill"}


@pytest.mark.slow
def test_pallas_engine_chunked_prefill_matches_xla(default_engine, interpret_default):
    """A 12-token budget splits the two long prompts over steps at offsets that are not page boundaries: later
    chunks attend to K/V cached by earlier steps, one prompt's chunk shares a ragged step with the other's first
    chunk, and decode steps of one request run beside prefill chunks of the other."""
    engine = pallas_engine(max_num_batched_tokens=12, max_num_seqs=2)
    prompts = PROMPTS[2:]
    assert min(len(engine.tokenizer.encode(p)) for p in prompts) > 12
    ran = record_shapes(engine)
    got = engine.generate(prompts, GREEDY, use_tqdm=False)
    expected = default_engine.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_generations(got, expected)
    # the budget is below the smallest prefill bucket (16): the one prefill shape is the budget itself
    assert engine.step_shapes() == [StepShape("decode", 1, 1), StepShape("decode", 2, 2),
                                    StepShape("prefill", 12, 2)]
    assert StepShape("prefill", 12, 2) in ran and {shape.kind for shape in ran} == {"decode", "prefill"}
