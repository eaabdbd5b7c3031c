"""quantization="int8" on a float checkpoint: projections, embedding table and LM head become Q8_0 blocks at load
(a quarter of float32's bytes); its logits are the float32 engine's on the same checkpoint with every such weight
rounded to int8 and back (only summation order differs), the embedded model's greedy tokens follow float32's, and
misuse is refused with a clear error."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import Engine, SamplingParams
from tests.hf_weights import redraw_weights
from tests.models.test_llama_parity import LOGITS_TEXT
from tests.prompt_logits import blocks_take_float_activations, prompt_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory, default_engine):
    """A tiny Llama checkpoint with an untied LM head and SmolLM2's tokenizer."""
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    redraw_weights(model)
    folder = tmp_path_factory.mktemp("int8-llama")
    model.save_pretrained(folder)
    default_engine.get_tokenizer().save_pretrained(folder)
    return str(folder)


def _rounded_through_int8(folder: str, tmp_path) -> str:
    """A copy of the checkpoint whose projections, embedding table and LM head went through Q8_0 and back."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jvllm.model_loader.gguf_blocks import dequantize_blocks
    from models.quantized import quantize_reference

    tensors = load_file(f"{folder}/model.safetensors")
    for name, array in tensors.items():
        if array.ndim == 2 and "norm" not in name:  # [out, in] or [V, D]: rows along the input dimension
            tensors[name] = dequantize_blocks(quantize_reference(array, "q8_0"), "q8_0").astype(array.dtype)
    shutil.copytree(folder, tmp_path / "rounded")
    save_file(tensors, str(tmp_path / "rounded" / "model.safetensors"), metadata={"format": "pt"})
    return str(tmp_path / "rounded")


def _engine(path: str, **overrides) -> Engine:
    """Products with the blocks in float32 (or int16) activations: no bfloat16 products on AVX-512 BF16 CPUs."""
    return Engine(path, kv_cache_memory_bytes=16 << 20, precompile=False, max_model_len=128, max_num_seqs=2,
                  **{"batched_weight_dtype": "none", **overrides})


def _blocks(engine: Engine) -> list[jax.Array]:
    return [leaf for leaf in jax.tree.leaves(engine.model.state) if leaf.dtype == jnp.uint8]


def test_int8_blocks_give_the_float32_logits_of_the_rounded_weights(untied_llama, tmp_path):
    int8 = _engine(untied_llama, quantization="int8")
    float32 = _engine(untied_llama, dtype="float32")
    rounded = _engine(_rounded_through_int8(untied_llama, tmp_path), dtype="float32")
    # 5 projections a layer (q, k and v in one: models.llama.Attention.fuse_qkv), the table, the head
    assert len(_blocks(int8)) == 2 * 5 + 2 and not _blocks(float32)
    assert int8.weight_bytes < 0.3 * float32.weight_bytes
    prompt = int8.get_tokenizer().encode(LOGITS_TEXT)[:32]  # one 32-row step
    got, want = prompt_logits(int8.runner, prompt), prompt_logits(rounded.runner, prompt)
    fraction = 1e-4 if blocks_take_float_activations(int8.runner, len(prompt)) else 1e-3  # int16 activations: ~3e-5 a product
    np.testing.assert_allclose(got, want, rtol=0, atol=fraction * np.abs(want).max())
    unrounded = prompt_logits(float32.runner, prompt)
    assert np.abs(got - unrounded).max() > 10 * np.abs(got - want).max()  # the rounding, not the order, differs


def test_the_embedded_model_in_int8_keeps_the_float32_greedy_tokens(default_engine):
    engine = Engine(str(default_engine.model.folder), quantization="int8", kv_cache_memory_bytes=64 << 20,
                    max_num_seqs=4, max_model_len=512, precompile=False)
    assert 140e6 < sum(leaf.nbytes for leaf in _blocks(engine)) < 150e6  # 135M weights at 34 bytes per 32
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=32)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    reference = [o.outputs[0].token_ids for o in default_engine.generate(prompts, params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(ours, reference)) >= 3, (ours, reference)


def test_misused_quantization_is_refused(untied_llama):
    from jvllm.model_loader.default_model import default_model_path

    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        Engine(untied_llama, quantization="int3", precompile=False)
    with pytest.raises(ValueError, match="is a GGUF file, which keeps its own blocks"):
        Engine(default_model_path(), quantization="int8", precompile=False)
    with pytest.raises(ValueError, match="runs on one device"):
        Engine(untied_llama, quantization="int8", tensor_parallel_size=2, precompile=False)
