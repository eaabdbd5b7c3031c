"""Flax NNX Gemma 2 and Gemma 3 text decoders: the Llama layout with (1 + w) RMSNorms around both the attention
and the GeGLU MLP, embeddings scaled by sqrt(hidden), interleaved sliding-window layers and tanh soft-caps."""
from __future__ import annotations

from typing import Container, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import MLP, GemmaRMSNorm, gelu_tanh, mlp_hf_parameters
from models.llama import Attention, EmbedLookup, HFParameter, LlamaForCausalLM, attention_hf_parameters
from models.rope import inverse_frequencies, rotary_tables

_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


class GemmaDecoderLayer(nnx.Module):
    """x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(x))): each sublayer normalized before and after."""

    def __init__(self, cfg: ModelConfig, index: int, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        for name in _LAYER_NORMS:
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype))
        self.self_attn = Attention(cfg, dtype, rngs, index, GemmaRMSNorm)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, gelu_tanh)

    def __call__(self, x, cos, sin, pages, md, attention):
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, pages, md, attention)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp_out).astype(x.dtype), new_kv


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`); the engine drives it as
    a Llama (embed, layers, finish)."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def embed(self, input_ids: jax.Array, positions: jax.Array, activation_dtype: jnp.dtype,
              embed: EmbedLookup | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (x [T, D] scaled by sqrt(D) rounded to the table's dtype, cos, sin): [T, hd], or [2, T, hd] holding
        the global and the local layers' tables when their RoPE bases differ (Gemma 3)."""
        x, cos, sin = super().embed(input_ids, positions, activation_dtype, embed)
        x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.embedding_dtype).astype(activation_dtype)
        cfg = self.config
        if cfg.local_rope_theta is not None:
            local_freq = inverse_frequencies(cfg.head_dim, cfg.local_rope_theta, None)
            local_cos, local_sin = rotary_tables(positions, local_freq)
            cos, sin = jnp.stack([cos, local_cos]), jnp.stack([sin, local_sin])
        return x, cos, sin

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [S, D] -> logits [S, V] float32, soft-capped by tanh where the config says."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def hf_parameters(self, available: Container[str]) -> Iterator[HFParameter]:
        yield from self.outer_hf_parameters(available)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            for name in _LAYER_NORMS:
                yield getattr(layer, name).weight, prefix + name + ".weight", False, ("embed",)
            yield from attention_hf_parameters(layer.self_attn, prefix + "self_attn.", False)
            yield from mlp_hf_parameters(layer.mlp, prefix + "mlp.")
