"""Flax NNX Qwen2.5-VL vision transformer: Qwen2-VL's packed 2D-rotary ViT, RMSNorms, gated MLPs, window attention."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bert import Dense
from models.clip import ACTIVATIONS, dense_parameters
from models.layers import RMSNorm
from models.params import normal_param
from models.qwen2_vl import Qwen2VisionTower, VisionAttention, split_tensors, text_config_dict
from models.vision_weights import VisionParameter, load_parameters

__all__ = ["Qwen25VisionConfig", "Qwen25VisionTower", "Qwen25VLConfig", "split_tensors", "text_config_dict"]

_EPS = 1e-6  # every RMSNorm of the tower and the merger


@dataclasses.dataclass(frozen=True)
class Qwen25VisionConfig:
    """A Qwen2.5-VL vision config (`qwen2_5_vl_vision`), read from its HF dict."""

    depth: int
    hidden_size: int  # the ViT's width
    out_hidden_size: int  # the language model's width: the merger's output
    intermediate_size: int
    hidden_act: str
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int  # in pixels
    fullatt_block_indexes: tuple[int, ...]  # the blocks attending over the whole image; the others within windows
    rope_theta: float = 10000.0

    @property
    def embed_dim(self) -> int:
        """The ViT's width under Qwen2-VL's name (models.qwen2_vl.VisionAttention reads it)."""
        return self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token."""
        return self.spatial_merge_size ** 2

    @property
    def window_patches(self) -> int:
        """A window's side in patches: transformers' windows are window_size // merge // patch merged tokens wide,
        tiling each image's merged grid from its top-left corner."""
        return self.spatial_merge_size * (self.window_size // self.spatial_merge_size // self.patch_size)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "Qwen25VisionConfig":
        """From a complete `vision_config` dict (transformers' Qwen2_5_VLConfig.to_dict()['vision_config'])."""
        model_type = hf.get("model_type", "qwen2_5_vl_vision")
        if model_type not in ("qwen2_5_vl_vision", "qwen2_5_vl"):
            raise ValueError(f"unsupported vision tower {model_type!r}; supported: qwen2_5_vl_vision")
        act = str(hf.get("hidden_act", "silu"))
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        rope = hf.get("rope_parameters") or {}
        cfg = cls(depth=int(hf["depth"]), hidden_size=int(hf["hidden_size"]),
                  out_hidden_size=int(hf["out_hidden_size"]), intermediate_size=int(hf["intermediate_size"]),
                  hidden_act=act, num_heads=int(hf["num_heads"]),
                  in_channels=int(hf.get("in_channels", hf.get("in_chans", 3))), patch_size=int(hf["patch_size"]),
                  spatial_merge_size=int(hf["spatial_merge_size"]),
                  temporal_patch_size=int(hf["temporal_patch_size"]), window_size=int(hf["window_size"]),
                  fullatt_block_indexes=tuple(int(i) for i in hf["fullatt_block_indexes"]),
                  rope_theta=float(rope.get("rope_theta", 10000.0)))
        if cfg.window_patches == 0:
            raise ValueError(f"window_size {cfg.window_size} is smaller than one merged token "
                             f"({cfg.spatial_merge_size * cfg.patch_size} pixels)")
        return cfg


@dataclasses.dataclass(frozen=True)
class Qwen25VLConfig:
    """What the vision side needs of a `Qwen2_5_VLForConditionalGeneration` config."""

    vision: Qwen25VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def text_hidden_size(self) -> int:
        return self.vision.out_hidden_size

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "Qwen25VLConfig":
        """From a complete config dict (transformers' Qwen2_5_VLConfig.to_dict(): nested configs with defaults)."""
        vision = Qwen25VisionConfig.from_hf_dict(hf["vision_config"])
        text_width = int(hf["text_config"]["hidden_size"])
        if vision.out_hidden_size != text_width:
            raise ValueError(f"the vision merger's output width {vision.out_hidden_size} is not the language model's "
                             f"hidden_size {text_width}")
        return cls(vision=vision, image_token_id=int(hf.get("image_token_id", 151655)),
                   video_token_id=int(hf.get("video_token_id", 151656)),
                   vision_start_token_id=int(hf.get("vision_start_token_id", 151652)),
                   vision_end_token_id=int(hf.get("vision_end_token_id", 151653)))


class VisionMlp(nnx.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), every projection with a bias."""

    def __init__(self, cfg: Qwen25VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = Dense(d, f, dtype, rngs), Dense(d, f, dtype, rngs)
        self.down_proj = Dense(f, d, dtype, rngs)
        self.act_name = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.act_name](self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
    """Pre-RMSNorm block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, cfg: Qwen25VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size, _EPS, dtype), RMSNorm(cfg.hidden_size, _EPS, dtype)
        self.attn = VisionAttention(cfg, dtype, rngs)
        self.mlp = VisionMlp(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """ln_q (RMSNorm), then each run of merge_unit consecutive patches concatenated and projected by
    mlp.2(GELU(mlp.0(.))) to the language model's width."""

    def __init__(self, cfg: Qwen25VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, _EPS, dtype)
        self.mlp0, self.mlp2 = Dense(width, width, dtype, rngs), Dense(width, cfg.out_hidden_size, dtype, rngs)
        self.width = width

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [P, D] -> [P // merge_unit, out_hidden_size]."""
        merged = self.ln_q(x).reshape(-1, self.width)  # [P / merge_unit, D * merge_unit]
        return self.mlp2(jax.nn.gelu(self.mlp0(merged), approximate=False))


class Qwen25VisionTower(nnx.Module):
    """Qwen2.5-VL's `visual`: patch embedding (the Conv3d as one matmul over flattened patches), `depth` blocks with
    2D rotary positions attending within windows (or the whole image in fullatt_block_indexes), the patch merger."""

    def __init__(self, cfg: Qwen25VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.config = cfg
        self.patch_embed = normal_param(rngs, (cfg.patch_dim, cfg.hidden_size), dtype)  # [patch_dim, D], no bias
        self.blocks = nnx.List([VisionBlock(cfg, dtype, rngs) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, dtype, rngs)

    rotary_tables = Qwen2VisionTower.rotary_tables  # Qwen2-VL's 2D tables: reads config.head_dim and rope_theta

    def __call__(self, patches: jax.Array, hw_positions: jax.Array, segments: jax.Array) -> jax.Array:
        """patches [P, patch_dim] (images back to back in the processor's order, then padding rows), hw_positions
        [P, 2] int32 (row, col) in the image's patch grid, segments [P] int32 (image index, -1 for padding) ->
        [P // merge_unit, out_hidden_size]. P must be a multiple of merge_unit. A video's frames each need a
        segment of their own (transformers attends, and windows, per frame)."""
        kernel = self.patch_embed[...]
        x = jnp.einsum("pk,kd->pd", patches.astype(kernel.dtype), kernel,
                       preferred_element_type=jnp.float32).astype(kernel.dtype)  # [P, D]
        cos, sin = self.rotary_tables(hw_positions)
        same_image = segments[:, None] == segments[None, :]  # [P, P]: padding rows see only padding rows
        window = hw_positions // self.config.window_patches  # [P, 2] (window row, window col)
        same_window = same_image & jnp.all(window[:, None, :] == window[None, :, :], axis=-1)  # [P, P]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, same_image if i in self.config.fullatt_block_indexes else same_window)
        return self.merger(x)

    def hf_parameters(self, prefix: str = "visual.") -> Iterator[VisionParameter]:
        """Every parameter with its HF name under `prefix`."""
        yield self.patch_embed, prefix + "patch_embed.proj.weight", True  # Conv3d [D, C, T, P, P]
        for i, block in enumerate(self.blocks):
            p = f"{prefix}blocks.{i}."
            yield block.norm1.weight, p + "norm1.weight", False
            yield block.norm2.weight, p + "norm2.weight", False
            yield from dense_parameters(block.attn.qkv, p + "attn.qkv")
            yield from dense_parameters(block.attn.proj, p + "attn.proj")
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield from dense_parameters(getattr(block.mlp, name), p + "mlp." + name)
        yield self.merger.ln_q.weight, prefix + "merger.ln_q.weight", False
        yield from dense_parameters(self.merger.mlp0, prefix + "merger.mlp.0")
        yield from dense_parameters(self.merger.mlp2, prefix + "merger.mlp.2")

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
        """Fill every parameter from canonically named tensors (split_tensors' vision side)."""
        load_parameters(self.hf_parameters(), tensors, dtype)
