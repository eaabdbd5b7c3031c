"""`batched_weight_dtype`: a bf16 copy of the weight matrices, used for steps of 2+ token rows."""
from __future__ import annotations

import gc
import logging
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jvllm import Engine, SamplingParams
from models.layers import OUT_IN_TRANSPOSED_DOT_MAX_ROWS, Linear, out_in_kernel_leaves, stored_out_in

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of", "One, two, three,"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def prompt_logprobs(engine: Engine) -> list[np.ndarray]:
    """Each prompt's own tokens' logprobs (all computed in one multi-row prefill step)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = engine.generate(PROMPTS, params, use_tqdm=False)
    return [np.array([next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]) for out in outputs]


def test_batched_copy_holds_bf16_matrices_and_serves_every_step(tiny_llama):
    full_engine = Engine(tiny_llama, precompile=False, max_num_seqs=4, batched_weight_dtype=None)
    engine = Engine(tiny_llama, precompile=False, max_num_seqs=4, batched_weight_dtype="bfloat16")
    runner = engine.runner
    from jvllm.worker.model_parts import split_model

    _, _, outer_state, layer_states = split_model(full_engine.model.graphdef, full_engine.model.state)
    out_in = out_in_kernel_leaves(outer_state) + [flag for state in layer_states for flag in out_in_kernel_leaves(state)]
    # down_proj in each of the 2 layers; q/k/v (joined at load: 64 -> 128) and gate/up (64 -> 256) widen
    assert sum(out_in) == 2
    assert len(out_in) == len(full_engine.runner.weights) == len(runner.batched_weights)
    for full, batched, flipped in zip(full_engine.runner.weights, runner.batched_weights, out_in):
        assert batched.shape == (full.T.shape if flipped else full.shape)
        np.testing.assert_array_equal(np.asarray(batched, np.float32),
                                      np.asarray(jnp.asarray(full.T if flipped else full, batched.dtype), np.float32))
        assert batched.dtype == (jnp.bfloat16 if full.ndim >= 2 else full.dtype)  # norms stay float32
    weights = runner.step_weights
    # one-token steps too, through the native one-row product (models.bf16_rows); XLA's own is slow
    assert weights.one_row_bf16 and weights.batched_min_rows == 1
    assert weights.for_rows(1) is weights.batched and not weights.one_row_dots_slow


@pytest.mark.parametrize("options,loaded_dtype", [({}, jnp.bfloat16),
                                                  ({"dtype": "float32", "batched_weight_dtype": "bfloat16"},
                                                   jnp.float32)])
def test_an_engine_whose_steps_all_read_the_copy_keeps_only_the_copy(tiny_llama, monkeypatch, caplog, options,
                                                                     loaded_dtype):
    """No step reads the loaded matrices, so the engine keeps only their shapes: what it holds is the bf16 copy and
    the float32 norms. By default (dtype "auto") the matrices are loaded in bf16 and never exist in float32; with
    dtype="float32" they are loaded in float32, copied and freed."""
    from jvllm.model_loader.loader import LoadedModel

    dropped: list[weakref.ref] = []
    drop = LoadedModel.drop_float_matrices

    def watched_drop(model: LoadedModel) -> None:
        matrices = [a for a in jax.tree.leaves(model.state) if a.ndim >= 2]
        assert matrices and all(a.dtype == loaded_dtype for a in matrices)
        dropped.extend(weakref.ref(a) for a in matrices)
        drop(model)

    monkeypatch.setattr(LoadedModel, "drop_float_matrices", watched_drop)
    with caplog.at_level(logging.INFO, logger="jvllm"):
        full_bytes = Engine(tiny_llama, precompile=False, max_num_seqs=4, batched_weight_dtype=None).weight_bytes
        engine = Engine(tiny_llama, precompile=False, max_num_seqs=4, **options)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert len(ready) == 2 and "(float32, weights" in ready[0] and "(float32 with bfloat16 matrices," in ready[1]
    assert engine.runner.step_weights.every_step_reads_the_copy
    assert engine.runner.step_weights.weights is engine.runner.step_weights.batched
    kept = [a for a in jax.tree.leaves(engine.model.state) if isinstance(a, jax.Array)]
    assert kept and all(a.ndim == 1 and a.dtype == jnp.float32 for a in kept)  # the norms
    assert engine.weight_bytes == sum(a.nbytes for a in engine.runner.weights)
    assert engine.weight_bytes < 0.6 * full_bytes  # half the matrices' bytes, the norms unchanged
    gc.collect()
    assert len(dropped) >= 2 * 4 + 1  # 4 matrices a layer, the table
    held = {id(a) for a in engine.runner.weights}
    assert all(ref() is None or id(ref()) in held for ref in dropped)  # freed unless the copy is that array
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_matrices_loaded_in_bf16_give_the_tokens_of_a_bf16_copy_of_float32_ones(tiny_llama):
    """Loading the matrices in bf16 (the default engine) rounds them as the copy of float32 matrices does: same
    logprobs, bit for bit, in multi-row and one-token steps. The default engine's KV pages are bf16 (its numbers are
    not float32's anyway), so the float32 engine is given bf16 pages too."""
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    runs = []
    for options in ({}, {"dtype": "float32", "batched_weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}):
        engine = Engine(tiny_llama, precompile=False, max_num_seqs=4, **options)
        assert engine.runner.kv_cache_dtype == jnp.bfloat16
        runs.append([(o.outputs[0].token_ids, [next(iter(e.values())).logprob for e in o.prompt_logprobs[1:]],
                      [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in engine.generate(PROMPTS, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_load_model_gives_a_decoder_its_matrices_in_the_matrix_dtype(tiny_llama):
    """`matrix_dtype`: every weight matrix in it, rounded from the checkpoint's values; norms keep the dtype."""
    from jvllm.model_loader.loader import load_model

    exact = load_model(tiny_llama, dtype="float32")
    rounded = load_model(tiny_llama, dtype="float32", matrix_dtype=jnp.bfloat16)
    pairs = list(zip(jax.tree.leaves(exact.state), jax.tree.leaves(rounded.state)))
    assert sum(a.ndim >= 2 for a, _ in pairs) >= 2 * 4 + 1 and any(a.ndim == 1 for a, _ in pairs)
    for a, b in pairs:
        assert b.dtype == (jnp.bfloat16 if a.ndim >= 2 else jnp.float32)
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a.astype(b.dtype), np.float32))
    drawn = load_model(tiny_llama, dtype="float32", load_format="dummy", matrix_dtype=jnp.bfloat16)
    assert [str(a.dtype) for a in jax.tree.leaves(drawn.state)] == [str(b.dtype) for _, b in pairs]


def test_pooling_on_a_generative_model_keeps_the_loaded_weights(tiny_llama):
    """The embedder of a generative model with pooling= reads the loaded weights, so they stay."""
    engine = Engine(tiny_llama, precompile=False, max_num_seqs=4, pooling="mean")
    assert engine.runner.step_weights.every_step_reads_the_copy
    assert engine.runner.step_weights.weights is not engine.runner.step_weights.batched
    assert any(a.ndim >= 2 and a.dtype == jnp.float32 for a in engine.runner.weights)
    assert len(engine.embed(["One, two, three,"], use_tqdm=False)[0].outputs.embedding) == 64


def test_bf16_weights_compute_the_same_model_within_bf16_rounding(tiny_llama):
    """Prompt logprobs from a multi-row prefill: bf16 weight copy vs float32 weights, same random model."""
    exact = prompt_logprobs(Engine(tiny_llama, precompile=False, max_num_seqs=4, batched_weight_dtype=None))
    rounded = prompt_logprobs(Engine(tiny_llama, precompile=False, max_num_seqs=4, batched_weight_dtype="bfloat16"))
    for a, b in zip(exact, rounded):
        assert a.shape == b.shape and len(a) > 3
        np.testing.assert_allclose(b, a, atol=5e-3, rtol=0)  # measured <= 1.3e-3; the values spread ~0.1-0.2
        assert not np.array_equal(a, b)  # the bf16 copy was really used


@pytest.mark.parametrize("rows", [1, 2, OUT_IN_TRANSPOSED_DOT_MAX_ROWS, OUT_IN_TRANSPOSED_DOT_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_linear_gives_the_same_result_from_an_out_in_kernel(rows, dtype):
    """Both dot forms of an [out, in] kernel (transposed product up to the row limit, direct above it)."""
    d_in, d_out = 96, 40
    assert stored_out_in(d_in, d_out) and not stored_out_in(d_out, d_in)
    layer = Linear(d_in, d_out, bias=True, dtype=dtype, rngs=nnx.Rngs(0))
    layer.bias.set_value(jnp.arange(d_out, dtype=dtype) / d_out)
    x = jax.random.normal(jax.random.key(1), (rows, d_in), jnp.float32)
    expected = np.asarray(layer(x))  # [rows, out] from the [in, out] kernel
    layer.kernel.set_value(layer.kernel[...].T)
    got = np.asarray(layer(x))
    assert got.shape == (rows, d_out)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_step_of_more_rows_than_the_transposed_dot_limit_matches_float32(tiny_llama):
    """A prefill step of > OUT_IN_TRANSPOSED_DOT_MAX_ROWS rows contracts the [out, in] kernels directly."""
    long_prompt = " ".join(["the cat sat on the mat and looked at the door"] * 10)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    results = []
    for dtype in (None, "bfloat16"):
        (out,) = Engine(tiny_llama, precompile=False, max_num_seqs=4, batched_weight_dtype=dtype).generate(long_prompt, params,
                                                                                          use_tqdm=False)
        results.append(np.array([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]))
    exact, rounded = results
    assert len(exact) > OUT_IN_TRANSPOSED_DOT_MAX_ROWS
    np.testing.assert_allclose(rounded, exact, atol=5e-3, rtol=0)
    assert not np.array_equal(rounded, exact)


@pytest.mark.parametrize("options,copy,loaded", [
    ({}, "bfloat16", "bfloat16"), ({"dtype": "float32"}, None, "float32"),
    ({"batched_weight_dtype": "none"}, None, "float32"), ({"batched_weight_dtype": None}, None, "float32"),
    ({"dtype": "bfloat16"}, None, "bfloat16"), ({"batched_weight_dtype": "bfloat16"}, "bfloat16", "bfloat16"),
    ({"dtype": "float32", "batched_weight_dtype": "bfloat16"}, "bfloat16", "float32")])
def test_auto_adds_a_bf16_copy_only_when_dtype_is_auto_too(tiny_llama, options, copy, loaded):
    """On CPU the default engine runs batched steps on a bf16 copy; dtype="float32" keeps every step in float32.
    The matrices are loaded in bf16 where dtype is "auto" and every step reads a bf16 copy (none in float32 then)."""
    engine = Engine(tiny_llama, precompile=False, max_num_seqs=4, **options)
    batched = engine.runner.step_weights.batched
    assert (batched is None) == (copy is None)
    if copy is not None:
        assert {str(w.dtype) for w in batched.leaves if w.ndim >= 2} == {copy}
        assert engine.runner.step_weights.for_rows(2) is batched
    assert engine.runner.step_weights.for_rows(1) is (batched or engine.runner.step_weights.weights)
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(engine.model.state) if leaf.ndim >= 2} == {loaded}


def test_one_token_steps_on_the_bf16_copy_keep_the_float32_models_tokens(tiny_llama):
    """Greedy one-token steps of the default engine run the native product on the bf16 copy (one custom call per
    product in the one-token layer); each token's logprob is the float32 engine's within bf16 rounding."""
    prompt = "The quick brown fox jumps over the lazy dog"
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    engine = Engine(tiny_llama, precompile=False, max_num_seqs=4)
    (out,) = engine.generate(prompt, params, use_tqdm=False)
    one_token = min(s for s in engine.runner.compiled._by_shape if s.kind == "decode")
    assert one_token.tokens == 1
    text = engine.runner.compiled.get(one_token).layer.as_text()
    assert text.count("jvllm_bf16_rows") >= 4  # q/k/v, o, gate/up, down
    tokens = list(out.outputs[0].token_ids)
    got = np.array([entry[token].logprob for entry, token in zip(out.outputs[0].logprobs, tokens)])
    exact = Engine(tiny_llama, precompile=False, max_num_seqs=4, dtype="float32")
    ids = exact.get_tokenizer().encode(prompt) + tokens
    (scored,) = exact.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)
    want = np.array([entry[token].logprob for entry, token in zip(scored.prompt_logprobs[-len(tokens):], tokens)])
    np.testing.assert_allclose(got, want, atol=5e-3, rtol=0)


def test_int8_asked_where_the_kernels_have_no_8_bit_tiles_is_logged_as_without_effect(monkeypatch, caplog):
    """batched_weight_dtype="int8" changes products only where the native kernels have 8-bit tiles (x86-64 CPUs with
    AVX2); elsewhere (a GPU, no native kernels) the engine says so once at start instead of ignoring the request."""
    from cpu_kernels.quantized_matmul import int8_tile_min_rows
    from jvllm.worker import weights

    assert weights.int8_tiles_here() == (int8_tile_min_rows() > 0)  # this test process runs on the CPU
    for has_tiles, warned in ((False, True), (True, False)):
        monkeypatch.setattr(weights, "int8_tiles_here", lambda has_tiles=has_tiles: has_tiles)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jvllm"):
            assert weights.int8_block_products("int8")
            assert not weights.int8_block_products("auto") and not weights.int8_block_products("bfloat16")
        said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
        assert len(said) == (1 if warned else 0), said
