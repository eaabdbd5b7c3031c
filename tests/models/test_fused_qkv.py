"""q, k and v held as one projection of their GGUF blocks (models.llama.Attention.fuse_qkv_blocks): the attention
gets the same q, k and v, to the bit, as from three projections; projections of different formats stay apart."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ModelConfig
from models.llama import Attention
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
    assert attn.fuse_qkv_blocks()
    assert attn.k_proj is None and attn.v_proj is None and attn.q_proj.d_out == (4 + 2 * 2) * 64
    together = seen_by_attention(attn, x)
    for name, a, b in zip(("q", "k", "v", "out"), apart, together):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert not attn.fuse_qkv_blocks()  # once


def test_projections_of_different_formats_stay_apart():
    attn = quantized_attention(("q4_1", "q4_1", "q8_0"))
    assert not attn.fuse_qkv_blocks()
    assert attn.k_proj is not None and attn.v_proj is not None
