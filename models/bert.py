"""Flax NNX BERT-family encoder (BERT, RoBERTa, XLM-R): bidirectional attention over padded [B, L] rows, and its
sequence-classification (cross-encoder) head."""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import EncoderConfig
from models.params import normal_param
from models.quantized import native_float32

_MASKED = -1e30  # finite: a fully padded row softmaxes to a harmless uniform instead of NaN


def gelu_erf(x: jax.Array) -> jax.Array:
    """The exact GELU as PyTorch computes it, x/2 (1 + erf(x / sqrt 2)). jax.nn.gelu's erfc form keeps its relative
    precision far into the negative tail, where the outputs are below 1e-6 anyway, at the cost of an exp and a
    division an element on XLA CPU (docs/design/serving.md, "Embeddings in bf16 ...")."""
    return x * 0.5 * (1.0 + jax.lax.erf(x * 0.7071067811865476))


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu_erf,  # transformers' "gelu" is the exact erf form
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


class Dense(nnx.Module):
    """y = x @ kernel + bias over the last axis; kernel [in, out], float32 accumulation."""

    def __init__(self, d_in: int, d_out: int, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.kernel = normal_param(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.product(x) + self.bias[...].astype(jnp.float32)).astype(x.dtype)

    def product(self, x: jax.Array) -> jax.Array:
        """x @ kernel without the bias, float32."""
        kernel = self.kernel[...]
        # The activation is cast to the weights' dtype (never the weights up): bf16 weights stay a
        # bf16 x bf16 -> f32 dot, the fast CPU path for big batches.
        return jnp.einsum("...d,de->...e", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class SelfAttention(nnx.Module):
    """Multi-head attention in which every real token sees every real token of its row (no causal mask)."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.qkv = Dense(d, 3 * d, dtype, rngs)  # query, key and value as one product: [D, 3D]
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: jax.Array, segments: jax.Array) -> jax.Array:
        """x [B, L, D], segments [B, L] (a token sees the tokens of its row with its own nonzero value) -> [B, L, D]."""
        batch, length, _ = x.shape
        if _native(x, self.qkv.bias[...]):  # each sequence's queries against its own keys only
            from cpu_kernels.encoder import segment_attention

            return segment_attention(self.qkv.product(x), segments, self.qkv.bias[...], self.num_heads)
        bias = attention_bias(segments)  # [B, L, L]
        # [B, L, 3D] -> [3, B, H, L, hd]: head-major einsums are faster on CPU
        q, k, v = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * self.head_dim ** -0.5
        scores = scores + bias[:, None]  # [B, H, L, L]
        weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        # Softmax normalized after the value product: one division over [B, H, L, hd] instead of [B, H, L, L]
        out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        out = out / jnp.sum(weights, axis=-1, keepdims=True)  # [B, H, L, hd]
        return out.transpose(0, 2, 1, 3).reshape(batch, length, -1).astype(x.dtype)


class EncoderLayer(nnx.Module):
    """Post-LayerNorm transformer block: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.attention = SelfAttention(cfg, dtype, rngs)
        self.attention_output = Dense(d, d, dtype, rngs)
        self.attention_norm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.intermediate = Dense(d, f, dtype, rngs)
        self.output = Dense(f, d, dtype, rngs)
        self.output_norm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: {', '.join(_ACTIVATIONS)}")
        self.act_name = cfg.hidden_act

    def __call__(self, x: jax.Array, segments: jax.Array) -> jax.Array:
        x = self.attention_norm(x + self.attention_output(self.attention(x, segments)))
        return self.output_norm(x + self.output(_ACTIVATIONS[self.act_name](self.intermediate(x))))


class BertModel(nnx.Module):
    """Embeddings (word + absolute position + token type, LayerNorm) and N encoder layers; no pooler."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.config = cfg
        self.word_embeddings = normal_param(rngs, (cfg.vocab_size, d), dtype)
        self.position_embeddings = normal_param(rngs, (cfg.max_position_embeddings, d), dtype)
        self.token_type_embeddings = normal_param(rngs, (max(cfg.type_vocab_size, 1), d), dtype)
        self.embeddings_norm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.layers = nnx.List([EncoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, positions: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        """input_ids, attention_mask [B, L] -> hidden [B, L, D].

        attention_mask is 0 for padding; a token attends to the tokens with its own nonzero value, so a 0/1
        mask is one sequence per row and packed rows number their sequences 1, 2, ... (`positions` [B, L] then
        restart at 0 for each; by default they count 0..L-1 along the row)."""
        x = self.embed(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x

    def embed(self, input_ids: jax.Array, positions: jax.Array | None = None,
              token_type_ids: jax.Array | None = None) -> jax.Array:
        """[B, L] -> the embedding layer's output [B, L, D]. Activations take the LayerNorm weights' dtype
        (float32 when only the matrices were cast to bf16)."""
        dtype = self.embeddings_norm.weight[...].dtype
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        x = self.word_embeddings[...][input_ids].astype(dtype)  # [B, L, D]
        x = x + self.position_embeddings[...][positions + self.config.position_offset].astype(dtype)
        types = self.token_type_embeddings[...]
        x = x + (types[0][None, None] if token_type_ids is None else types[token_type_ids]).astype(dtype)
        return self.embeddings_norm(x)

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
        """Fill every parameter from HF-named tensors, with or without a `bert.`/`roberta.` style prefix."""
        prefix = _weight_prefix(tensors)

        def take(name: str, transpose: bool = False) -> jax.Array:
            for candidate in _legacy_names(prefix + name):
                if candidate in tensors:
                    array = np.asarray(tensors[candidate])
                    return jnp.asarray(array.T if transpose else array, dtype=dtype)
            raise ValueError(f"weights are missing tensor {prefix + name!r}")

        def dense(module: Dense, name: str) -> None:
            module.kernel.set_value(take(name + ".weight", transpose=True))
            module.bias.set_value(take(name + ".bias"))

        def norm(module: LayerNorm, name: str) -> None:
            module.weight.set_value(take(name + ".weight"))
            module.bias.set_value(take(name + ".bias"))

        self.word_embeddings.set_value(take("embeddings.word_embeddings.weight"))
        self.position_embeddings.set_value(take("embeddings.position_embeddings.weight"))
        self.token_type_embeddings.set_value(take("embeddings.token_type_embeddings.weight"))
        norm(self.embeddings_norm, "embeddings.LayerNorm")
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            projections = [p + "attention.self." + proj for proj in ("query", "key", "value")]
            qkv = layer.attention.qkv
            qkv.kernel.set_value(jnp.concatenate([take(name + ".weight", transpose=True) for name in projections], 1))
            qkv.bias.set_value(jnp.concatenate([take(name + ".bias") for name in projections]))
            dense(layer.attention_output, p + "attention.output.dense")
            norm(layer.attention_norm, p + "attention.output.LayerNorm")
            dense(layer.intermediate, p + "intermediate.dense")
            dense(layer.output, p + "output.dense")
            norm(layer.output_norm, p + "output.LayerNorm")



class BertForSequenceClassification(nnx.Module):
    """A cross-encoder: BertModel, then on each sequence's first token ([CLS] / <s>) a dense + tanh pooler and a
    linear classifier to num_labels logits. BERT checkpoints name the two `bert.pooler.dense` and `classifier`,
    RoBERTa-family ones `classifier.dense` and `classifier.out_proj` (the same computation)."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.config = cfg
        self.encoder = BertModel(cfg, dtype, rngs)
        self.pooler = Dense(d, d, dtype, rngs)
        self.classifier = Dense(d, cfg.num_labels, dtype, rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, positions: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        """[B, L] -> the encoder's hidden states [B, L, D] (see BertModel.__call__)."""
        return self.encoder(input_ids, attention_mask, positions, token_type_ids)

    def classify(self, first: jax.Array) -> jax.Array:
        """First-token hidden states [S, D] -> logits [S, num_labels] float32."""
        return self.classifier(jnp.tanh(self.pooler(first))).astype(jnp.float32)

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
        self.encoder.load_hf_weights(tensors, dtype)
        if "classifier.out_proj.weight" in tensors:
            pooler, classifier = "classifier.dense", "classifier.out_proj"
        else:
            pooler, classifier = _weight_prefix(tensors) + "pooler.dense", "classifier"
        for module, name in ((self.pooler, pooler), (self.classifier, classifier)):
            missing = [key for key in (name + ".weight", name + ".bias") if key not in tensors]
            if missing:
                raise ValueError(f"weights are missing tensor {missing[0]!r} of the classification head")
            module.kernel.set_value(jnp.asarray(np.asarray(tensors[name + ".weight"]).T, dtype=dtype))
            module.bias.set_value(jnp.asarray(np.asarray(tensors[name + ".bias"]), dtype=dtype))


def _native(*arrays: jax.Array) -> bool:
    """Whether `arrays` take the native encoder attention (float32 on XLA CPU with the kernels built)."""
    return native_float32(*arrays)


def attention_bias(attention_mask: jax.Array) -> jax.Array:
    """[B, L] segment mask (0 padding) -> [B, L, L] float32 bias: 0 where query and key share a segment."""
    same = (attention_mask[:, :, None] == attention_mask[:, None, :]) & (attention_mask[:, None, :] > 0)
    return jnp.where(same, 0.0, _MASKED).astype(jnp.float32)


def _weight_prefix(tensors: Mapping[str, np.ndarray]) -> str:
    """'' for BertModel checkpoints, 'bert.' for BertForMaskedLM and the like, 'roberta.' for RoBERTa heads."""
    anchor = "embeddings.word_embeddings.weight"
    for name in tensors:
        if name.endswith(anchor):
            return name[: -len(anchor)]
    raise ValueError(f"weights have no tensor named like {anchor!r}: not a BERT-family checkpoint")


def _legacy_names(name: str) -> tuple[str, ...]:
    """Old TF-converted checkpoints name LayerNorm parameters gamma/beta."""
    if name.endswith("LayerNorm.weight"):
        return name, name[: -len("weight")] + "gamma"
    if name.endswith("LayerNorm.bias"):
        return name, name[: -len("bias")] + "beta"
    return (name,)
