"""Flax NNX CLIP vision tower (ViT with a class token, pre-LayerNorm blocks, quick-GELU MLPs), as LLaVA uses it."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from models.bert import _ACTIVATIONS, Dense, LayerNorm
from models.params import normal_param
from models.vision_weights import VisionParameter

ACTIVATIONS = {**_ACTIVATIONS, "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
    """A CLIP vision config (`clip_vision_model`), read from its HF dict."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def grid(self) -> int:
        """Patches along each side of the (square) input image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ClipVisionConfig":
        if hf.get("model_type", "clip_vision_model") not in ("clip_vision_model", "clip"):
            raise ValueError(f"unsupported vision tower {hf.get('model_type')!r}; supported: clip_vision_model")
        act = str(hf.get("hidden_act", "quick_gelu"))
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        return cls(hidden_size=int(hf["hidden_size"]), intermediate_size=int(hf["intermediate_size"]),
                   num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
                   image_size=int(hf["image_size"]), patch_size=int(hf["patch_size"]),
                   num_channels=int(hf.get("num_channels", 3)), layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
                   hidden_act=act)


class ClipAttention(nnx.Module):
    """Bidirectional multi-head attention over every token of an image."""

    def __init__(self, cfg: ClipVisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.q_proj, self.k_proj = Dense(d, d, dtype, rngs), Dense(d, d, dtype, rngs)
        self.v_proj, self.out_proj = Dense(d, d, dtype, rngs), Dense(d, d, dtype, rngs)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, L, D] -> [B, L, D]."""
        batch, length, _ = x.shape

        def heads(y: jax.Array) -> jax.Array:  # [B, L, D] -> [B, H, L, hd]
            return y.reshape(batch, length, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * self.head_dim ** -0.5
        weights = jax.nn.softmax(scores, axis=-1)  # [B, H, L, L] float32
        out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1).astype(x.dtype))


class ClipEncoderLayer(nnx.Module):
    """Pre-LayerNorm block: x + attn(LN1(x)), then + fc2(act(fc1(LN2(x))))."""

    def __init__(self, cfg: ClipVisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.self_attn = ClipAttention(cfg, dtype, rngs)
        self.layer_norm2 = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.fc1, self.fc2 = Dense(d, f, dtype, rngs), Dense(f, d, dtype, rngs)
        self.act_name = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(ACTIVATIONS[self.act_name](self.fc1(self.layer_norm2(x))))


class ClipVisionTower(nnx.Module):
    """Patch embedding (the stride-P convolution as one matmul over flattened patches), class token, learned
    positions, pre-LayerNorm and the first `num_layers` encoder layers (the deepest hidden state a caller selects;
    the rest of the checkpoint's layers and its post-LayerNorm are never computed)."""

    def __init__(self, cfg: ClipVisionConfig, num_layers: int, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        self.config = cfg
        self.class_embedding = normal_param(rngs, (d,), dtype)
        self.patch_embedding = normal_param(rngs, (c * p * p, d), dtype)  # [C*P*P, D]: the conv kernel flattened
        self.position_embedding = normal_param(rngs, (cfg.num_patches + 1, d), dtype)
        self.pre_layrnorm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.layers = nnx.List([ClipEncoderLayer(cfg, dtype, rngs) for _ in range(num_layers)])

    def hidden_states(self, pixel_values: jax.Array) -> list[jax.Array]:
        """pixel_values [B, C, H, W] -> the embeddings' output and each layer's, [B, 1 + patches, D] each
        (transformers' `hidden_states`, up to this tower's last layer)."""
        cfg = self.config
        batch, channels = pixel_values.shape[:2]
        g, p = cfg.grid, cfg.patch_size
        kernel = self.patch_embedding[...]
        patches = pixel_values.reshape(batch, channels, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)  # [B, g, g, C, P, P]
        patches = patches.reshape(batch, g * g, channels * p * p).astype(kernel.dtype)
        x = jnp.einsum("bnk,kd->bnd", patches, kernel, preferred_element_type=jnp.float32).astype(kernel.dtype)
        cls = jnp.broadcast_to(self.class_embedding[...][None, None], (batch, 1, cfg.hidden_size)).astype(x.dtype)
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...][None].astype(x.dtype)
        states = [self.pre_layrnorm(x)]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return states

    def hf_parameters(self, prefix: str) -> Iterator[VisionParameter]:
        """Every parameter with its HF name under `prefix` (e.g. 'vision_tower.')."""
        yield self.class_embedding, prefix + "embeddings.class_embedding", False
        yield self.patch_embedding, prefix + "embeddings.patch_embedding.weight", True  # conv [D, C, P, P]
        yield self.position_embedding, prefix + "embeddings.position_embedding.weight", False
        yield from _norm(self.pre_layrnorm, prefix + "pre_layrnorm")
        for i, layer in enumerate(self.layers):
            p = f"{prefix}encoder.layers.{i}."
            yield from _norm(layer.layer_norm1, p + "layer_norm1")
            yield from _norm(layer.layer_norm2, p + "layer_norm2")
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                yield from dense_parameters(getattr(layer.self_attn, name), p + "self_attn." + name)
            yield from dense_parameters(layer.fc1, p + "mlp.fc1")
            yield from dense_parameters(layer.fc2, p + "mlp.fc2")


def dense_parameters(module: Dense, name: str) -> Iterator[VisionParameter]:
    yield module.kernel, name + ".weight", True
    yield module.bias, name + ".bias", False


def _norm(module: LayerNorm, name: str) -> Iterator[VisionParameter]:
    yield module.weight, name + ".weight", False
    yield module.bias, name + ".bias", False
