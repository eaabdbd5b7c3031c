"""Model resolution and weight formats: dummy weights, the GGUF conversion cache, clear errors."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jvllm import Engine, SamplingParams
from jvllm.model_loader.loader import _converted_folder, load_model, resolve_dtype


def test_dummy_weights_have_the_real_shapes_but_random_values(tiny_model_factory):
    folder = tiny_model_factory("llama")
    real = load_model(str(folder), dtype="float32")
    dummy = load_model(str(folder), dtype="float32", load_format="dummy")
    real_leaves, dummy_leaves = jax.tree.leaves(real.state), jax.tree.leaves(dummy.state)
    assert [x.shape for x in real_leaves] == [x.shape for x in dummy_leaves]
    embed_real, embed_dummy = np.asarray(real_leaves[0]), np.asarray(dummy_leaves[0])
    assert embed_real.shape == embed_dummy.shape and not np.allclose(embed_real, embed_dummy)


def test_dummy_engine_generates_requested_token_count(tiny_model_factory):
    engine = Engine(str(tiny_model_factory("llama")), load_format="dummy", kv_cache_memory_bytes=8 << 20,
                    precompile=False)
    out = engine.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_gguf_conversion_is_cached_for_the_next_start(default_engine):
    from jvllm.model_loader.default_model import default_model_path

    folder = _converted_folder(default_model_path())
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def test_unknown_load_format_and_dtype_are_clear_errors(tiny_model_factory):
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tiny_model_factory("llama")), load_format="pickle")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8")


def test_dtype_auto_is_float32_on_cpu():
    assert jax.default_backend() == "cpu"
    assert np.dtype(resolve_dtype("auto")) == np.float32


def test_read_safetensors_keeps_values_and_dtypes(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file

    from jvllm.model_loader.loader import read_safetensors

    rng = np.random.default_rng(0)
    arrays = {"bf16": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
              "f16": rng.normal(size=(4,)).astype(np.float16), "f32": rng.normal(size=(2, 2)).astype(np.float32)}
    save_file({"f32": arrays["f32"]}, str(tmp_path / "a.safetensors"))
    save_file({k: arrays[k] for k in ("bf16", "f16")}, str(tmp_path / "b.safetensors"))
    got = read_safetensors(tmp_path)
    assert sorted(got) == sorted(arrays)
    for name, expected in arrays.items():
        assert got[name].dtype == expected.dtype
        np.testing.assert_array_equal(got[name].astype(np.float32), expected.astype(np.float32))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        read_safetensors(tmp_path / "missing")


def test_dynamic_ntk_scaling_is_the_default_rotation_within_max_position_embeddings():
    """transformers rescales the base only for sequences past max_position_embeddings, which max_model_len never
    exceeds; an unsupported scaling type names the supported ones."""
    from models.config import ModelConfig
    from models.rope import inverse_frequencies

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=256)
    dynamic = ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    plain = ModelConfig.from_hf_dict(base)
    np.testing.assert_array_equal(inverse_frequencies(16, 10000.0, dynamic.rope_scaling_dict),
                                  inverse_frequencies(16, 10000.0, plain.rope_scaling_dict))
    with pytest.raises(ValueError, match="supported: default, linear, llama3, yarn, dynamic, longrope, mrope"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "fope", "factor": 2.0}})
