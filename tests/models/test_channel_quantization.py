"""Per-channel int8 and fp8 weights (the accelerator formats of quantization="int8" / "fp8"), run on CPU through the
same jnp code a GPU runs: codes and scales as the format defines them, the projection against dequantize-then-float
matmuls within the format's rounding, and a tiny random Llama with the fp8 accelerator format forced, whose logits
are the float32 engine's on the checkpoint rounded through the same codes."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.channel_quant import CHANNEL_FORMATS, channel_dot, channel_rows, dequantize_channels, quantize_channels
from models.layers import Linear
from tests.hf_weights import save_byte_level_tokenizer
from tests.prompt_logits import prompt_logits

FORMATS = sorted(CHANNEL_FORMATS)
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 320, 64, 160, 2, 4, 2
PROMPT = "the quick brown fox jumps over the lazy dog"


def weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    """float32 [n, k] ~ N(0, 1/k), one row of zeros and one with an outlier (its codes spread the least)."""
    w = np.random.default_rng(seed).normal(0, k ** -0.5, (n, k)).astype(np.float32)
    w[1] = 0.0
    w[2, 3] = 40 * k ** -0.5
    return w


def rounding_bound(w: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    """[N, K]: how far a weight may move when quantized: half a step of int8, or e4m3fn's half ulp (2^-4 relative
    for normals; 2^-10 steps of the scale below e4m3fn's smallest normal, 2^-6)."""
    if CHANNEL_FORMATS[fmt].integer:
        return np.broadcast_to(scale[:, None] / 2, w.shape)
    return np.maximum(np.abs(w) * 2.0 ** -4, scale[:, None] * 2.0 ** -10)


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_and_scales_follow_the_format(fmt):
    spec = CHANNEL_FORMATS[fmt]
    w = weights(48, 96)
    codes, scale = quantize_channels(jnp.asarray(w), fmt)
    codes_t, scale_t = quantize_channels(jnp.asarray(w.T), fmt, transposed=True)  # a Linear kernel [in, out]
    assert codes.dtype == spec.dtype and codes.shape == (48, 96) and scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(codes_t), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(scale_t), np.asarray(scale))
    codes32, scale = np.asarray(codes).astype(np.float32), np.asarray(scale)
    absmax = np.abs(w).max(axis=1)
    live = absmax > 0
    np.testing.assert_allclose(scale[live], absmax[live] / spec.max_code, rtol=3e-7)  # XLA may divide by reciprocal
    assert scale[1] == 1.0 and not codes32[1].any()  # the zero row
    np.testing.assert_array_equal(np.abs(codes32[live]).max(axis=1), spec.max_code)  # each row's range is used
    error = np.abs(np.asarray(dequantize_channels(codes, jnp.asarray(scale))) - w)
    assert (error <= rounding_bound(w, scale, fmt) * (1 + 1e-6)).all()
    if spec.integer:
        np.testing.assert_array_equal(codes32, np.clip(np.round(w / scale[:, None]), -127, 127))


@pytest.mark.parametrize("activations", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_projection_is_the_dequantized_float_matmul(fmt, activations):
    """x @ W^T from the codes: the float64 product with the dequantized weights up to float32 summation (the codes
    convert exactly to bf16, and bf16 x bf16 products are exact in float32), and within the format's rounding of
    the product with the float weights."""
    w = weights(80, 128, seed=1)
    x = jnp.asarray(np.random.default_rng(2).normal(0, 1, (5, 128)), activations)  # [T, K]
    codes, scale = quantize_channels(jnp.asarray(w), fmt)
    y = jax.jit(channel_dot)(x, codes, scale)  # [T, N]
    assert y.dtype == jnp.float32 and y.shape == (5, 80)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    dequantized = np.asarray(dequantize_channels(codes, scale), np.float64)
    magnitude = np.abs(x64) @ np.abs(dequantized).T  # [T, N]
    np.testing.assert_array_less(np.abs(np.asarray(y) - x64 @ dequantized.T), 1e-6 * magnitude + 1e-30)
    quantization_error = np.abs(np.asarray(y) - x64 @ w.T.astype(np.float64))
    bound = np.abs(x64) @ rounding_bound(w, np.asarray(scale), fmt).T + 1e-6 * magnitude
    assert (quantization_error <= bound).all() and quantization_error.max() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_and_embedding_rows_take_the_channel_path(fmt):
    layer = Linear(96, 48, bias=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer.bias.set_value(jnp.full((48,), 0.5, jnp.bfloat16))
    codes, scale = quantize_channels(layer.kernel[...], fmt, transposed=True)  # [48, 96], [48]
    with pytest.raises(ValueError, match="scales of a 96 -> 48 projection are float32"):
        layer.set_quantized(codes, fmt)
    with pytest.raises(ValueError, match="codes of a 96 -> 48 projection"):
        layer.set_quantized(codes.T, fmt, scale)
    layer.set_quantized(codes, fmt, scale)
    x = jnp.ones((3, 96), jnp.bfloat16)
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(channel_dot(x, codes, scale) + 0.5), rtol=1e-2)
    rows = channel_rows(codes, scale, jnp.asarray([4, 0, 4]))  # [3, 96]
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(dequantize_channels(codes, scale))[[4, 0, 4]])


def test_the_backend_picks_the_format():
    from jvllm.model_loader.quantize_weights import storage_format
    from jvllm.worker.weights import cast_matrices

    assert [storage_format("int8", b) for b in ("cpu", "gpu", "cuda")] == ["q8_0", "int8_channel", "int8_channel"]
    assert storage_format("fp8", "gpu") == "fp8_channel"
    with pytest.raises(ValueError, match="runs on GPUs"):
        storage_format("fp8", "cpu")
    codes = jnp.zeros((4, 8), jnp.float8_e4m3fn)  # a bf16 copy of the weights keeps the codes as they are
    assert cast_matrices([codes, jnp.zeros((4, 8))], jnp.bfloat16, [True, False])[0] is codes


# ---- engine level: a tiny random Llama (a byte-level tokenizer, float32 safetensors; no torch) ----

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """(folder, its tensors): 2 layers, untied LM head, HF names and [out, in] layouts."""
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("channel-llama")
    save_byte_level_tokenizer(folder, PROMPT)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "vocab_size": VOCAB,
              "bos_token_id": 0, "eos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    tensors = {"model.embed_tokens.weight": rng.normal(0, 1, (VOCAB, HIDDEN)),
               "lm_head.weight": rng.normal(0, 0.2, (VOCAB, HIDDEN)), "model.norm.weight": np.ones(HIDDEN)}
    shapes = {"self_attn.q_proj": (HEADS * head_dim, HIDDEN), "self_attn.k_proj": (KV_HEADS * head_dim, HIDDEN),
              "self_attn.v_proj": (KV_HEADS * head_dim, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * head_dim),
              "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = rng.normal(0, shape[1] ** -0.5, shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = 1 + rng.normal(0, 0.1, HIDDEN)
    tensors = {name: array.astype(np.float32) for name, array in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder), tensors


def _rounded(tiny_llama, fmt: str, folder) -> str:
    """A copy of the checkpoint whose matrices went through `fmt`'s codes and back."""
    import shutil

    from safetensors.numpy import save_file

    source, tensors = tiny_llama
    rounded = {name: np.asarray(dequantize_channels(*quantize_channels(jnp.asarray(a), fmt))) if a.ndim == 2 else a
               for name, a in tensors.items()}
    shutil.copytree(source, folder)
    save_file(rounded, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.fixture
def accelerator_formats(monkeypatch):
    """quantization= picks the GPU formats on this CPU (the engine itself stays on XLA CPU)."""
    from jvllm.model_loader import quantize_weights

    monkeypatch.setattr(quantize_weights, "load_backend", lambda: "gpu")


def _engine(path: str, **overrides):
    from jvllm import Engine

    return Engine(path, kv_cache_memory_bytes=4 << 20, precompile=False, max_model_len=128, max_num_seqs=2,
                  **overrides)


def test_engine_logits_are_the_rounded_checkpoints(tiny_llama, accelerator_formats, tmp_path):
    """fp8: its codes are a float dtype, which the bf16 weight copy for batched steps must leave alone (the prompt
    runs on that copy). int8 shares the loading and the product, and its codes are checked above."""
    fmt = "fp8_channel"
    quantized = _engine(tiny_llama[0], quantization="fp8", dtype="float32", batched_weight_dtype="bfloat16")
    rounded = _engine(_rounded(tiny_llama, fmt, tmp_path / "rounded"), dtype="float32")
    codes = [leaf for leaf in jax.tree.leaves(quantized.model.state) if leaf.dtype == CHANNEL_FORMATS[fmt].dtype]
    # 4 projections a layer (q, k and v in one, gate and up in one: models.llama.fuse_projections), table, head
    assert len(codes) == LAYERS * 4 + 2
    assert quantized.weight_bytes < 0.3 * rounded.weight_bytes
    prompt = quantized.get_tokenizer().encode(PROMPT)
    got, want = prompt_logits(quantized.runner, prompt), prompt_logits(rounded.runner, prompt)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # the GPU's configuration: bfloat16 activations, within bfloat16's rounding
    bf16 = prompt_logits(_engine(tiny_llama[0], quantization="fp8", dtype="bfloat16").runner, prompt)
    np.testing.assert_allclose(bf16, want, rtol=0, atol=0.03 * np.abs(want).max())


def test_fp8_on_cpu_is_refused_before_loading(tiny_llama):
    with pytest.raises(ValueError, match="quantization='fp8' runs on GPUs"):
        _engine(tiny_llama[0], quantization="fp8")
