"""Flax NNX Qwen2.5-VL vision transformer: Qwen2-VL's packed 2D-rotary ViT, RMSNorms, gated MLPs, window attention."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.bert import Dense
from models.clip import ACTIVATIONS
from models.layers import RMSNorm
from models.qwen2_vl import PatchGeometry, Qwen2VisionTower, split_tensors, text_config_dict

__all__ = ["Qwen25VisionConfig", "Qwen25VisionTower", "Qwen25VLConfig", "split_tensors", "text_config_dict"]


@dataclasses.dataclass(frozen=True)
class Qwen25VisionConfig(PatchGeometry):
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
        """The ViT's width under Qwen2-VL's name (the shared blocks and merger of models.qwen2_vl read it)."""
        return self.hidden_size

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

    parameter_names = ("gate_proj", "up_proj", "down_proj")  # the HF names of its Dense layers, under "mlp."

    def __init__(self, cfg: Qwen25VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = Dense(d, f, dtype, rngs), Dense(d, f, dtype, rngs)
        self.down_proj = Dense(f, d, dtype, rngs)
        self.act_name = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.act_name](self.gate_proj(x)) * self.up_proj(x))


class Qwen25VisionTower(Qwen2VisionTower):
    """Qwen2.5-VL's `visual`: Qwen2-VL's tower with RMSNorms and gated MLPs, its blocks attending within windows
    (or over the whole image in fullatt_block_indexes)."""

    norm = RMSNorm
    mlp = VisionMlp

    def block_masks(self, hw_positions: jax.Array, segments: jax.Array) -> list[jax.Array]:
        """Windows of window_patches x window_patches patches tiling each image from its top-left corner; the
        full-attention blocks see the whole image."""
        same_image = segments[:, None] == segments[None, :]  # [P, P]: padding rows see only padding rows
        window = hw_positions // self.config.window_patches  # [P, 2] (window row, window col)
        same_window = same_image & jnp.all(window[:, None, :] == window[None, :, :], axis=-1)  # [P, P]
        full = self.config.fullatt_block_indexes
        return [same_image if i in full else same_window for i in range(len(self.blocks))]
