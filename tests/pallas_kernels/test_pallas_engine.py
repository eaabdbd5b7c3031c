"""The engine on the `pallas` backend: interpret mode on CPU gives the `xla` backend's greedy tokens on the default
model (whole prompts and chunked prefill), and the full prefill and decode steps lower for CUDA on a CPU machine."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax._src.lib import triton
from jax._src.lib import version as jaxlib_version

from jvllm import Engine, SamplingParams
from jvllm.worker.batch import build_batch, chunk_rows
from jvllm.worker.model_runner import prompt_logprob_targets
from jvllm.sample.tensors import build_sampling_tensors

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
    grow with the pool)."""
    settings = dict(attention_backend="pallas", kv_cache_memory_bytes=16 * PAGE_BYTES_F32, max_model_len=64,
                    max_num_seqs=4)
    settings.update(overrides)
    engine = Engine(**settings)
    assert engine.runner.backend.name == "pallas" and engine.runner.backend.step_donates_pool
    return engine


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
    got = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = default_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_generations(got, expected)
    shapes = engine.runner.compiled_shapes
    assert any(key[3] == 1 for key in shapes) and any(key[3] > 1 for key in shapes)  # decode and prefill steps


@pytest.mark.slow
def test_pallas_engine_chunked_prefill_matches_xla(default_engine, interpret_default):
    """A 12-token budget splits the two long prompts over steps at offsets that are not page boundaries: later
    chunks attend to K/V cached by earlier steps, one prompt's chunk shares a ragged step with the other's first
    chunk, and decode steps of one request run beside prefill chunks of the other."""
    engine = pallas_engine(max_num_batched_tokens=12, max_num_seqs=2)
    prompts = PROMPTS[2:]
    assert min(len(engine.tokenizer.encode(p)) for p in prompts) > 12
    got = engine.generate(prompts, GREEDY, use_tqdm=False)
    expected = default_engine.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_generations(got, expected)
    assert all(key[1] <= 12 for key in engine.runner.compiled_shapes)


# ---- CUDA lowering of the engine's steps (issue 3, item 4) ------------------------------------------------------

def lower_step_for_cuda(engine: Engine, chunks) -> str:
    """StableHLO text of the runner's forward_sample for `chunks`, with inputs built as ModelRunner.step_call
    builds them."""
    runner = engine.runner
    batch = build_batch(chunk_rows(chunks), runner.page_size, runner.limits, runner.backend.table_pages)
    sampling, flags = build_sampling_tensors([runner._row_spec(c) for c in chunks], batch.metadata.q_lens.shape[0])
    prompt_targets, _ = prompt_logprob_targets(chunks, batch.input_ids.shape[0])
    as_spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    lowered = runner.steps.forward_sample.trace(
        jax.tree.map(as_spec, runner.weights), jax.tree.map(as_spec, runner.kv_cache), batch.input_ids,
        batch.positions, batch.metadata, sampling, prompt_targets, flags=flags,
    ).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def pool_aliases(text: str, pool_type: str) -> tuple[int, list[int]]:
    """-> (number of pool arguments of the main function, the output indices they alias). Every pool argument
    must be donated (tf.aliasing_output, or jax.buffer_donor when the output is not yet chosen), nothing else."""
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    args = re.findall(r"%arg\d+: (tensor<[^>]*>)( \{[^}]*\})?", main)
    pools, aliased = 0, []
    for arg_type, attrs in args:
        if arg_type == pool_type:
            pools += 1
            found = re.search(r"tf\.aliasing_output = (\d+)", attrs)
            assert found or "jax.buffer_donor" in attrs, f"pool argument {arg_type} {attrs} is not donated"
            if found:
                aliased.append(int(found.group(1)))
        else:
            assert "tf.aliasing_output" not in attrs and "jax.buffer_donor" not in attrs, (arg_type, attrs)
    return pools, aliased


def triton_calls(text: str) -> int:
    return text.count("@__gpu$xla.gpu.triton") + text.count("@triton_kernel_call")


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("step", ["prefill", "decode"])
# jax 0.11 warns that the Triton lowering of pallas_call is deprecated; that must not fail CI
@pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")
@pytest.mark.skipif(jaxlib_version > (0, 10, 2) and not triton.has_compilation_handler("cuda"),
                    reason="this jaxlib compiles Triton kernels while lowering and has no CUDA plugin")
def test_engine_steps_lower_for_cuda(monkeypatch, step, block_size):
    """The default model's architecture (dummy weights, bfloat16 as on a GPU): one Triton attention kernel per
    layer, the KV write an XLA scatter, the pool donated. The engine is built and traced with compiled kernels
    forced on; nothing runs."""
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "0")  # read when the kernels are traced
    engine = Engine(load_format="dummy", dtype="bfloat16", attention_backend="pallas", block_size=block_size,
                    kv_cache_memory_bytes=12 * 2 * 30 * 3 * 64 * 2 * block_size, max_model_len=128,
                    max_num_seqs=4)
    model = engine.model.config
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for index, length in enumerate([5, 21, 40]):
        engine.add_request(str(index), {"prompt_token_ids": list(range(100, 100 + length))}, greedy)
    chunks = engine.scheduler.schedule()  # the three whole prompts: one prefill step
    if step == "decode":
        engine.scheduler.commit(chunks)  # pretend the prefill ran and sampled one token per request
        for chunk in chunks:
            chunk.request.output_token_ids.append(7)
        chunks = engine.scheduler.schedule()
        assert [c.num_tokens for c in chunks] == [1, 1, 1]
    else:
        assert [c.num_tokens for c in chunks] == [5, 21, 40]

    text = lower_step_for_cuda(engine, chunks)
    assert triton_calls(text) == model.num_layers  # one attention kernel per layer
    kernel = "jvllm_decode_attention" if step == "decode" else "jvllm_ragged_paged_attention"
    assert kernel in text
    assert "stablehlo.scatter" in text
    pool_type = f"tensor<{engine.config.num_pages}x{block_size}x{model.num_kv_heads}x{model.head_dim}xbf16>"
    pools, aliased = pool_aliases(text, pool_type)
    assert pools == 2 * model.num_layers  # K and V of each layer
    if aliased:  # tf.aliasing_output: each pool is updated in place into its own output
        assert len(aliased) == len(set(aliased)) == pools
