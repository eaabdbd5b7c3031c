"""q, k and v held as one projection, and gate and up as one (models.llama.fuse_projections): with GGUF blocks the
attention gets the same q, k and v, to the bit, as from three projections; float kernels and per-channel codes give
the separate products' values; projections holding different kinds of weights stay apart."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ModelConfig
from models.channel_quant import quantize_channels
from models.layers import MLP, gelu_tanh, join_columns, split_columns
from models.llama import Attention, LlamaForCausalLM, fuse_projections
from models.quantized import quantize_reference

CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "num_hidden_layers": 1,
          "vocab_size": 1000, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


def quantized_attention(formats: tuple[str, str, str], seed: int = 0) -> Attention:
    """A Qwen2 attention layer (biased q/k/v) whose q, k, v kernels hold blocks of `formats`."""
    attn = Attention(ModelConfig.from_hf_dict(CONFIG), jnp.float32, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for proj, fmt in zip((attn.q_proj, attn.k_proj, attn.v_proj), formats):
        proj.bias = nnx.Param(jnp.asarray(rng.standard_normal(proj.d_out), jnp.float32))
        rows = np.asarray(proj.kernel[...], np.float32).T  # [out, in]
        proj.set_quantized(jnp.asarray(quantize_reference(rows, fmt)), fmt)
    return attn


def seen_by_attention(attn: Attention, x: jax.Array) -> tuple[np.ndarray, ...]:
    """(q, k, v) as the attention call receives them, and the layer's output."""
    seen = {}

    def attention(q, k, v, pages, md, scale, window, soft_cap):
        seen.update(q=q, k=k, v=v)
        return q, None

    tokens = x.shape[0]
    cos = jnp.ones((tokens, attn.head_dim // 2), jnp.float32)
    sin = jnp.zeros((tokens, attn.head_dim // 2), jnp.float32)
    out, _ = attn(x, cos, sin, None, None, attention)
    return tuple(np.asarray(a) for a in (seen["q"], seen["k"], seen["v"], out))


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_one_projection_gives_the_three_projections_bits(fmt, rows):
    attn = quantized_attention((fmt, fmt, fmt))
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 256)), jnp.float32)
    apart = seen_by_attention(attn, x)
    assert attn.fuse_qkv()
    assert attn.k_proj is None and attn.v_proj is None and attn.q_proj.d_out == (4 + 2 * 2) * 64
    together = seen_by_attention(attn, x)
    for name, a, b in zip(("q", "k", "v", "out"), apart, together):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert not attn.fuse_qkv()  # once


def test_projections_of_different_formats_stay_apart():
    attn = quantized_attention(("q4_1", "q4_1", "q8_0"))
    assert not attn.fuse_qkv()
    assert attn.k_proj is not None and attn.v_proj is not None


def float_attention(dtype, seed: int = 0) -> Attention:
    """A Qwen2 attention layer (biased q/k/v) with random float kernels of `dtype`."""
    attn = Attention(ModelConfig.from_hf_dict(CONFIG), dtype, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.bias = nnx.Param(jnp.asarray(rng.standard_normal(proj.d_out), dtype))
    return attn


def with_channel_codes(projections, fmt: str) -> None:
    """Each projection's float kernel [in, out] replaced by per-channel codes of `fmt`."""
    for proj in projections:
        codes, scale = quantize_channels(proj.kernel[...], fmt, transposed=True)  # [out, in], [out]
        proj.set_quantized(codes, fmt, scale)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8_channel", "fp8_channel"])
def test_float_and_channel_qkv_give_the_three_projections_values(kind):
    dtype = jnp.bfloat16 if kind == "bfloat16" else jnp.float32
    attn = float_attention(dtype)
    if kind.endswith("_channel"):
        with_channel_codes((attn.q_proj, attn.k_proj, attn.v_proj), kind)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((7, 256)), dtype)
    apart = seen_by_attention(attn, x)
    assert attn.fuse_qkv()
    assert attn.k_proj is None and attn.v_proj is None and attn.q_proj.d_out == (4 + 2 * 2) * 64
    together = seen_by_attention(attn, x)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5  # bf16 outputs: one rounding apart at most
    for name, a, b in zip(("q", "k", "v", "out"), apart, together):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(b, a, rtol=tolerance, atol=tolerance * np.abs(a).max(), err_msg=name)
    assert not attn.fuse_qkv()


def test_kernels_of_different_dtypes_stay_apart():
    attn = float_attention(jnp.float32)
    attn.v_proj.kernel = nnx.Param(attn.v_proj.kernel[...].astype(jnp.bfloat16))
    assert not attn.fuse_qkv()
    assert attn.k_proj is not None and attn.v_proj is not None


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("kind", ["float32", "int8_channel"])
def test_gate_and_up_as_one_projection_give_the_mlp_output(kind, activation):
    mlp = MLP(256, 512, jnp.float32, nnx.Rngs(1), jax.nn.silu if activation == "silu" else gelu_tanh)
    if kind != "float32":
        with_channel_codes((mlp.gate_proj, mlp.up_proj, mlp.down_proj), kind)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 256)), jnp.float32)
    apart = np.asarray(mlp(x))
    assert mlp.fuse_gate_up()
    assert mlp.up_proj is None and mlp.gate_proj.d_out == 1024
    np.testing.assert_allclose(np.asarray(mlp(x)), apart, rtol=1e-5, atol=1e-5 * np.abs(apart).max())
    assert not mlp.fuse_gate_up()


def test_gguf_gate_and_up_stay_apart_for_the_native_gated_product():
    mlp = MLP(256, 512, jnp.float32, nnx.Rngs(1))
    for proj in (mlp.gate_proj, mlp.up_proj):
        proj.set_quantized(jnp.asarray(quantize_reference(np.asarray(proj.kernel[...]).T, "q8_0")), "q8_0")
    assert not mlp.fuse_gate_up()
    assert mlp.up_proj is not None


def layer_outputs(model: LlamaForCausalLM, x: jax.Array) -> np.ndarray:
    """x [T, D] through every decoder layer, with an attention stand-in that mixes q, k and v -> [T, D]."""
    def attention(q, k, v, pages, md, scale, window, soft_cap):
        return 0.5 * q + jnp.repeat(k + v, q.shape[1] // k.shape[1], axis=1), None

    cos = jnp.ones((x.shape[0], 32), jnp.float32)
    sin = jnp.zeros((x.shape[0], 32), jnp.float32)
    for layer in model.layers:
        x, _ = layer(x, cos, sin, None, None, attention)
    return np.asarray(x)


def test_a_fused_model_keeps_its_layers_outputs_and_refuses_hf_names():
    """A whole model: fusing every layer leaves what the layers compute; HF tensor names no longer map onto its
    parameters."""
    model = LlamaForCausalLM(ModelConfig.from_hf_dict({**CONFIG, "num_hidden_layers": 2}), jnp.float32, nnx.Rngs(5))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((9, 256)), jnp.float32)
    before = layer_outputs(model, x)
    assert fuse_projections(model) == (2, 2)
    np.testing.assert_allclose(layer_outputs(model, x), before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    with pytest.raises(ValueError, match="fused after loading"):
        list(model.hf_parameters(set()))


@pytest.mark.parametrize("shards", [2, 4])
def test_columns_joined_per_shard_split_back_to_each_projection(shards):
    """Tensor parallelism's layout, where each device holds a block of every projection's columns: joined within
    each of `shards` blocks ([a_0 | b_0 | c_0 | a_1 | ...]), the product's output splits back into each projection's
    own product, and every block of the joined kernel holds only that block's columns of each."""
    rng = np.random.default_rng(shards)
    widths = (8 * shards, 2 * shards, 2 * shards)
    kernels = [jnp.asarray(rng.standard_normal((16, w)), jnp.float32) for w in widths]  # [in, out_i]
    joined = join_columns(kernels, shards)
    assert joined.shape == (16, sum(widths))
    block = sum(widths) // shards
    for s in range(shards):
        own = [np.asarray(k)[:, s * w // shards:(s + 1) * w // shards] for k, w in zip(kernels, widths)]
        want = np.concatenate(own, axis=1)
        np.testing.assert_array_equal(np.asarray(joined)[:, s * block:(s + 1) * block], want)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    for part, kernel in zip(split_columns(x @ joined, widths, shards), kernels):
        np.testing.assert_allclose(np.asarray(part), np.asarray(x @ kernel), rtol=1e-5, atol=1e-5)
