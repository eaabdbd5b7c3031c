"""Runs of several layers in one executable (JVLLM_LAYERS_PER_CALL, decode steps) give the tokens and logprobs of
one layer per call, with fewer layer calls per step."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gpu_models import TINY_BASE, TINY_FAMILIES, write_folder
from jvllm.worker.layer_runs import (LAYERS_PER_CALL_ENV, SHORT_PREFILL_TOKENS, LayerRun, first_runs,
                                     layers_per_call, runs_by_kind, runs_kind, short_prefill_tokens, split_layers,
                                     whole_step_runs)


def test_split_layers_covers_every_layer_in_order():
    runs = split_layers((0, 0, 1, 0, 1), 2)
    assert runs == [LayerRun(0, (0, 0)), LayerRun(2, (1, 0)), LayerRun(4, (1,))]
    assert [i for run in runs for i in range(run.start, run.stop)] == [0, 1, 2, 3, 4]
    assert split_layers((0, 0, 0), 8) == [LayerRun(0, (0, 0, 0))]
    assert first_runs(split_layers((0, 0, 0, 0, 0), 2)) == {(0, 0): LayerRun(0, (0, 0)), (0,): LayerRun(4, (0,))}
    by_kind = runs_by_kind((0, 1, 0), 2)
    assert by_kind["decode"] == [LayerRun(0, (0, 1)), LayerRun(2, (0,))]
    assert by_kind["prefill"] == [LayerRun(0, (0,)), LayerRun(1, (1,)), LayerRun(2, (0,))]


def test_short_prefill_steps_take_the_decode_runs_and_whole_steps_every_one():
    assert runs_kind("decode", 256) == "decode"
    assert runs_kind("prefill", SHORT_PREFILL_TOKENS) == "decode"
    assert runs_kind("prefill", 2 * SHORT_PREFILL_TOKENS) == "prefill"
    assert short_prefill_tokens(whole_steps=False) == SHORT_PREFILL_TOKENS
    assert runs_kind("prefill", 4096, short_prefill_tokens(whole_steps=True)) == "decode"


def test_whole_steps_where_the_native_cpu_attention_runs():
    """XLA's own attention (and the Pallas kernels in interpret mode) make a layer's program large: its engines call
    one layer at a time on a CPU as on a GPU."""
    assert whole_step_runs("cpu", "cpu")
    assert not whole_step_runs("cpu", "xla") and not whole_step_runs("cpu", "pallas")
    assert not whole_step_runs("gpu", "pallas") and not whole_step_runs("gpu", "mosaic")


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_layers_per_call_is_refused(monkeypatch, value):
    monkeypatch.setenv(LAYERS_PER_CALL_ENV, value)
    with pytest.raises(ValueError, match=LAYERS_PER_CALL_ENV):
        layers_per_call()


def test_layers_per_call_takes_the_callers_default_unless_set(monkeypatch):
    monkeypatch.delenv(LAYERS_PER_CALL_ENV, raising=False)
    assert layers_per_call() == 1
    assert layers_per_call(30) == 30
    monkeypatch.setenv(LAYERS_PER_CALL_ENV, " 4 ")
    assert layers_per_call(30) == 4


def _generate(folder, tokenizer, backend: str, monkeypatch, per_call: int | None):
    """(tokens, logprobs, layer calls per decode step, decode and prefill steps' layer patterns); per_call None: the
    default."""
    from jvllm import Engine, SamplingParams

    if per_call is None:
        monkeypatch.delenv(LAYERS_PER_CALL_ENV, raising=False)
    else:
        monkeypatch.setenv(LAYERS_PER_CALL_ENV, str(per_call))
    engine = Engine(str(folder), tokenizer=str(tokenizer), load_format="dummy", dtype="float32", seed=0,
                    attention_backend=backend, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128,
                    kv_cache_memory_bytes=8 << 20, precompile=False)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(100, 49000, size=n).tolist()} for n in (3, 21, 90)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    compiled = engine.runner.compiled._by_shape
    decode = next(shape for shape in compiled if shape.kind == "decode")
    calls_per_step = len(engine.runner.layer_runs(decode))
    patterns = {groups for shape, executables in compiled.items() if shape.kind == "decode"
                for groups in executables.layers}
    prefill_patterns = {groups for shape, executables in compiled.items() if shape.kind == "prefill"
                        for groups in executables.layers}
    tokens = [out.outputs[0].token_ids for out in outputs]
    logprobs = [[step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                for out in outputs]
    return tokens, logprobs, calls_per_step, (patterns, prefill_patterns)


# the prompts (3, 21 and 90 tokens, two sequences a step) prefill in a short step, which takes the decode steps'
# runs, and one past SHORT_PREFILL_TOKENS, which takes the prefill steps' runs unless those are whole steps too
@pytest.mark.parametrize("family,backend,per_call,calls,patterns", [
    # sliding, sliding | full: runs of two structures and two lengths
    ("gemma3", "xla", 2, 2, ({(0, 0), (1,)}, {(0, 0), (1,), (0,)})),
    ("llama", "xla", 8, 1, ({(0, 0, 0, 0, 0)}, {(0, 0, 0, 0, 0), (0,)})),  # every layer in one call; long prefill: one
    ("llama", "cpu", None, 1, ({(0, 0, 0, 0, 0)}, {(0, 0, 0, 0, 0)})),  # the native attention's default: whole steps
    ("llama", "xla", None, 5, ({(0,)}, {(0,)})),  # XLA's attention: one layer a call by default
    ("llama", "pallas", 2, 3, ({(0, 0), (0,)}, {(0, 0), (0,)})),  # the kernels' pool donated per run
])
def test_runs_of_layers_give_the_tokens_of_one_layer_per_call(tmp_path, smollm_tokenizer_dir, monkeypatch, family,
                                                              backend, per_call, calls, patterns):
    layers = {"llama": 5}.get(family, TINY_BASE["num_hidden_layers"])
    config = {**TINY_BASE, "num_hidden_layers": layers, **TINY_FAMILIES[family]}
    folder = write_folder(tmp_path / family, config, None)
    one_tokens, one_logprobs, one_calls, _ = _generate(folder, smollm_tokenizer_dir, backend, monkeypatch, 1)
    run_tokens, run_logprobs, run_calls, run_patterns = _generate(folder, smollm_tokenizer_dir, backend, monkeypatch,
                                                                  per_call)
    assert one_calls == config["num_hidden_layers"] and run_calls == calls
    assert run_patterns == patterns
    assert run_tokens == one_tokens
    np.testing.assert_allclose(np.concatenate(run_logprobs), np.concatenate(one_logprobs), rtol=0, atol=1e-5)


def test_counted_as_work_keeps_every_value_bit_for_bit():
    """x_out times exactly 1: zeros keep their sign, infinities and NaNs stay what they were. (Subnormals flush to 0,
    as in every XLA CPU op: executables run with flush-to-zero and denormals-are-zero set.)"""
    import jax
    import jax.numpy as jnp

    from jvllm.worker.step_functions import counted_as_work

    x_in = jnp.asarray(np.random.default_rng(2).standard_normal((3, 40)), jnp.float32)
    x_out = np.asarray([[-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5e-38, -3.5, 7e37]] * 2, np.float32)
    got = np.asarray(jax.jit(counted_as_work)(x_in, jnp.asarray(x_out)))
    np.testing.assert_array_equal(got.view(np.uint32)[:, :4], x_out.view(np.uint32)[:, :4])
    np.testing.assert_array_equal(got, x_out)  # NaN where NaN
    assert got.dtype == np.float32


def test_a_cpu_engines_layer_runs_count_as_work_for_xlas_cpu_client(tmp_path, smollm_tokenizer_dir):
    """XLA's CPU client runs an executable inside its call, on the calling thread, when its inputs are ready and its
    cost analysis counts fewer than 1,000 flops; the native kernels count as none. Every layer run of a CPU engine
    counts more, so a step dispatched after the previous one ended is queued like any other: the host's work for
    the next step overlaps it."""
    from jvllm import Engine, SamplingParams

    folder = write_folder(tmp_path / "llama", {**TINY_BASE, "num_hidden_layers": 2, **TINY_FAMILIES["llama"]}, None)
    engine = Engine(str(folder), tokenizer=str(smollm_tokenizer_dir), load_format="dummy", dtype="float32", seed=0,
                    max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128, kv_cache_memory_bytes=8 << 20,
                    precompile=False)
    engine.generate([{"prompt_token_ids": [101, 102, 103]}], SamplingParams(max_tokens=3), use_tqdm=False)
    runs = [piece for executables in engine.runner.compiled._by_shape.values()
            for piece in executables.layers.values()]
    assert runs
    for piece in runs:
        analysis = piece.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        assert analysis["flops"] >= 1000
