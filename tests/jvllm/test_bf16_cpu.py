"""A bfloat16 model on the CPU: its KV pool stored as bits that no step converts; one-token steps on the native
one-row product, or padded to 2 rows without it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jvllm import Engine, SamplingParams
from tests.step_hlo import compiled_step_hlo

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def bf16_engine(tiny_llama):
    assert jax.default_backend() == "cpu"
    return Engine(tiny_llama, dtype="bfloat16", max_num_seqs=4, precompile=False)


def run_and_capture(engine: Engine, prompts: list[str]) -> tuple[list, list]:
    """-> (generated token ids per prompt, every StepCall the runner ran)."""
    runner = engine.runner
    calls = []
    run_call = runner.run_call
    runner.run_call = lambda call, *args: (calls.append(call), run_call(call, *args))[1]
    try:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        runner.run_call = run_call
    return [list(out.outputs[0].token_ids) for out in outputs], calls


def test_the_pool_holds_bits_and_a_decode_step_converts_none_of_it(bf16_engine):
    """XLA CPU gathers a bfloat16 pool by converting all of it to float32 first, every step (SmolLM2: 1.9 tok/s);
    stored as uint16 no array of the pool's shape is made in any other dtype."""
    runner = bf16_engine.runner
    assert all(k.dtype == v.dtype == jnp.uint16 for k, v in runner.kv_cache)
    _, calls = run_and_capture(bf16_engine, ["The capital of France is"])
    decode = [c for c in calls if c.shape.kind == "decode"][-1]
    hlo = compiled_step_hlo(runner, decode)["layer"]
    pool_shape = "[" + ",".join(map(str, runner.kv_cache[0][0].shape)) + "]"
    assert f"u16{pool_shape}" in hlo
    for dtype in ("f32", "bf16"):
        assert f"{dtype}{pool_shape}" not in hlo


def test_one_token_steps_stay_one_row_and_a_request_gets_its_batch_tokens_alone(bf16_engine):
    """One-token steps multiply the bf16 weights through the native one-row product (models.bf16_rows), so a lone
    request's steps keep one token row; its tokens are those it gets in a batch of three."""
    assert bf16_engine.runner.shapes.min_rows == 1 and bf16_engine.step_shapes()[0].tokens == 1
    prompts = ["The capital of France is", "One, two, three,", "def f(x):"]
    alone, calls = run_and_capture(bf16_engine, prompts[:1])
    assert any(c.shape.kind == "decode" and c.input_ids.shape[0] == 1 for c in calls)
    together, _ = run_and_capture(bf16_engine, prompts)
    assert alone[0] == together[0] and len(alone[0]) == GREEDY.max_tokens


def test_without_the_native_product_every_step_has_two_rows(tiny_llama, monkeypatch):
    """A 1-row bf16 dot is ~10x slower on XLA CPU than a 2-row one: where the native product is not available, a
    lone request's steps are padded to 2 token rows and 2 sequences; the padding changes none of its tokens."""
    import jvllm.worker.weights

    monkeypatch.setattr(jvllm.worker.weights, "bf16_rows_available", lambda: False)
    engine = Engine(tiny_llama, dtype="bfloat16", max_num_seqs=4, precompile=False)
    assert engine.runner.shapes.min_rows == 2 and engine.step_shapes()[0].tokens == 2
    prompts = ["The capital of France is", "One, two, three,", "def f(x):"]
    alone, calls = run_and_capture(engine, prompts[:1])
    assert calls and all(c.input_ids.shape[0] >= 2 and c.metadata.q_lens.shape[0] >= 2 for c in calls)
    together, _ = run_and_capture(engine, prompts)
    assert alone[0] == together[0] and len(alone[0]) == GREEDY.max_tokens
    assert Engine(tiny_llama, max_num_seqs=4, precompile=False).runner.shapes.min_rows == 1  # float32 weights: 1-row steps stay
