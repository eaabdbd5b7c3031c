"""Flax NNX Qwen2-VL vision transformer: packed images' patches through 2D-rotary ViT blocks and the patch merger."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bert import _MASKED, Dense, LayerNorm
from models import vision_weights
from models.clip import ACTIVATIONS, dense_parameters
from models.vision_weights import VisionParameter, load_parameters
from models.params import normal_param
from models.rope import apply_rotary

_EPS = 1e-6  # every norm of the tower and the merger (Qwen2.5-VL's too)
# Checkpoint name prefixes -> canonical ones: transformers >= 4.52 names the parts model.visual.*,
# model.language_model.*, lm_head.*; older checkpoints (and the Qwen hub repos) visual.*, model.*, lm_head.*.
_PREFIXES = (
    ("model.visual.", "visual."), ("visual.", "visual."),
    ("model.language_model.", "model."), ("model.", "model."), ("lm_head.", "lm_head."),
)


class PatchGeometry:
    """What the Qwen-VL vision configs derive alike from their embed_dim, num_heads, in_channels, patch_size,
    temporal_patch_size and spatial_merge_size."""

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token."""
        return self.spatial_merge_size ** 2


@dataclasses.dataclass(frozen=True)
class Qwen2VisionConfig(PatchGeometry):
    """A Qwen2-VL vision config (`qwen2_vl_vision`), read from its HF dict."""

    depth: int
    embed_dim: int
    hidden_size: int  # the language model's width: the merger's output
    hidden_act: str
    mlp_ratio: float
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    rope_theta: float = 10000.0

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def out_hidden_size(self) -> int:
        """The merger's output width (Qwen2.5-VL's config name for it)."""
        return self.hidden_size

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "Qwen2VisionConfig":
        """From a complete `vision_config` dict (transformers' Qwen2VLConfig.to_dict()['vision_config'])."""
        model_type = hf.get("model_type", "qwen2_vl_vision")
        if model_type not in ("qwen2_vl_vision", "qwen2_vl"):
            raise ValueError(f"unsupported vision tower {model_type!r}; supported: qwen2_vl_vision")
        act = str(hf.get("hidden_act", "quick_gelu"))
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        rope = hf.get("rope_parameters") or {}
        return cls(depth=int(hf["depth"]), embed_dim=int(hf["embed_dim"]), hidden_size=int(hf["hidden_size"]),
                   hidden_act=act, mlp_ratio=float(hf["mlp_ratio"]), num_heads=int(hf["num_heads"]),
                   in_channels=int(hf.get("in_channels", hf.get("in_chans", 3))), patch_size=int(hf["patch_size"]),
                   spatial_merge_size=int(hf["spatial_merge_size"]),
                   temporal_patch_size=int(hf["temporal_patch_size"]),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclasses.dataclass(frozen=True)
class Qwen2VLConfig:
    """What the vision side needs of a `Qwen2VLForConditionalGeneration` config."""

    vision: Qwen2VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def text_hidden_size(self) -> int:
        return self.vision.hidden_size

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "Qwen2VLConfig":
        """From a complete config dict (transformers' Qwen2VLConfig.to_dict(): nested configs with their defaults)."""
        vision = Qwen2VisionConfig.from_hf_dict(hf["vision_config"])
        text_width = int(hf["text_config"]["hidden_size"])
        if vision.hidden_size != text_width:
            raise ValueError(f"the vision merger's output width {vision.hidden_size} is not the language model's "
                             f"hidden_size {text_width}")
        return cls(vision=vision, image_token_id=int(hf.get("image_token_id", 151655)),
                   video_token_id=int(hf.get("video_token_id", 151656)),
                   vision_start_token_id=int(hf.get("vision_start_token_id", 151652)),
                   vision_end_token_id=int(hf.get("vision_end_token_id", 151653)))


def text_config_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config dict (a Qwen2 decoder with multimodal RoPE), as Qwen2ForCausalLM."""
    text = {**hf["text_config"], "architectures": ["Qwen2ForCausalLM"]}
    if text.get("eos_token_id") is None and hf.get("eos_token_id") is not None:
        text["eos_token_id"] = hf["eos_token_id"]
    if "tie_word_embeddings" in hf:  # the outer config's decides (transformers >= 5)
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


class VisionAttention(nnx.Module):
    """Bidirectional attention among the patches of one image, 2D rotary on queries and keys."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d = cfg.embed_dim
        self.qkv, self.proj = Dense(d, 3 * d, dtype, rngs), Dense(d, d, dtype, rngs)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, same_image: jax.Array) -> jax.Array:
        """x [P, D], cos/sin [P, hd] float32, same_image [P, P] bool (query row, key column) -> [P, D]."""
        length = x.shape[0]
        qkv = self.qkv(x).reshape(length, 3, self.num_heads, self.head_dim)  # [P, 3, H, hd]
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [P, H, hd] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * self.head_dim ** -0.5
        scores = jnp.where(same_image[None], scores, _MASKED)  # [H, P, P]
        weights = jax.nn.softmax(scores, axis=-1)  # float32
        out = jnp.einsum("hqk,khd->qhd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return self.proj(out.reshape(length, -1).astype(x.dtype))


class VisionMlp(nnx.Module):
    """fc2(act(fc1(x)))."""

    parameter_names = ("fc1", "fc2")  # the HF names of its Dense layers, under "mlp."

    def __init__(self, cfg: Qwen2VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.fc1 = Dense(cfg.embed_dim, cfg.mlp_dim, dtype, rngs)
        self.fc2 = Dense(cfg.mlp_dim, cfg.embed_dim, dtype, rngs)
        self.act_name = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(ACTIVATIONS[self.act_name](self.fc1(x)))


class VisionBlock(nnx.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)); `norm` and `mlp` are the family's classes."""

    def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs | None, norm: type, mlp: type):
        self.norm1, self.norm2 = norm(cfg.embed_dim, _EPS, dtype), norm(cfg.embed_dim, _EPS, dtype)
        self.attn = VisionAttention(cfg, dtype, rngs)
        self.mlp = mlp(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """ln_q, then each run of merge_unit consecutive patches (one merge block) concatenated and projected by
    mlp.2(GELU(mlp.0(.))) to the language model's width."""

    def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs | None, norm: type):
        width = cfg.embed_dim * cfg.merge_unit
        self.ln_q = norm(cfg.embed_dim, _EPS, dtype)
        self.mlp0, self.mlp2 = Dense(width, width, dtype, rngs), Dense(width, cfg.out_hidden_size, dtype, rngs)
        self.width = width

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [P, D] -> [P // merge_unit, out_hidden_size]."""
        merged = self.ln_q(x).reshape(-1, self.width)  # [P / merge_unit, D * merge_unit]
        return self.mlp2(jax.nn.gelu(self.mlp0(merged), approximate=False))


class Qwen2VisionTower(nnx.Module):
    """Qwen2-VL's `visual`: patch embedding (the Conv3d as one matmul over flattened patches), `depth` blocks with
    per-image attention and 2D rotary positions, and the patch merger. Qwen2.5-VL's tower (models.qwen2_5_vl) is
    this one with other `norm` and `mlp` classes and windowed blocks (`block_masks`)."""

    norm: type = LayerNorm
    mlp: type = VisionMlp

    def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.config = cfg
        self.patch_embed = normal_param(rngs, (cfg.patch_dim, cfg.embed_dim), dtype)  # [patch_dim, D], no bias
        self.blocks = nnx.List([VisionBlock(cfg, dtype, rngs, self.norm, self.mlp) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, dtype, rngs, self.norm)

    def __call__(self, patches: jax.Array, hw_positions: jax.Array, segments: jax.Array) -> jax.Array:
        """patches [P, patch_dim] (images back to back in the processor's order, then padding rows), hw_positions
        [P, 2] int32 (row, col) in the image's patch grid, segments [P] int32 (image index, -1 for padding) ->
        [P // merge_unit, out_hidden_size]. P must be a multiple of merge_unit. A video's frames would each need a
        segment of their own."""
        kernel = self.patch_embed[...]
        x = jnp.einsum("pk,kd->pd", patches.astype(kernel.dtype), kernel,
                       preferred_element_type=jnp.float32).astype(kernel.dtype)  # [P, D]
        cos, sin = self.rotary_tables(hw_positions)
        for block, mask in zip(self.blocks, self.block_masks(hw_positions, segments)):
            x = block(x, cos, sin, mask)
        return self.merger(x)

    def block_masks(self, hw_positions: jax.Array, segments: jax.Array) -> list[jax.Array]:
        """Per block, which keys [P, P] each query sees: every patch of its own image (padding rows see only
        padding rows)."""
        same_image = segments[:, None] == segments[None, :]  # [P, P]
        return [same_image] * len(self.blocks)

    def rotary_tables(self, hw_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """hw_positions [P, 2] -> (cos, sin) [P, hd] float32: the first hd/4 frequencies of each half turn with
        the row, the next hd/4 with the column."""
        half = self.config.head_dim // 2
        inv_freq = 1.0 / self.config.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half)  # [hd/4]
        angles = hw_positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [P, 2, hd/4]
        angles = angles.reshape(angles.shape[0], half)  # [P, hd/2]: rows' angles, then columns'
        angles = jnp.concatenate([angles, angles], axis=-1)  # [P, hd]
        return jnp.cos(angles), jnp.sin(angles)

    def hf_parameters(self, prefix: str = "visual.") -> Iterator[VisionParameter]:
        """Every parameter with its HF name under `prefix`."""
        yield self.patch_embed, prefix + "patch_embed.proj.weight", True  # Conv3d [D, C, T, P, P]
        for i, block in enumerate(self.blocks):
            p = f"{prefix}blocks.{i}."
            yield from _norm_parameters(block.norm1, p + "norm1")
            yield from _norm_parameters(block.norm2, p + "norm2")
            yield from dense_parameters(block.attn.qkv, p + "attn.qkv")
            yield from dense_parameters(block.attn.proj, p + "attn.proj")
            for name in block.mlp.parameter_names:
                yield from dense_parameters(getattr(block.mlp, name), p + "mlp." + name)
        yield from _norm_parameters(self.merger.ln_q, prefix + "merger.ln_q")
        yield from dense_parameters(self.merger.mlp0, prefix + "merger.mlp.0")
        yield from dense_parameters(self.merger.mlp2, prefix + "merger.mlp.2")

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
        """Fill every parameter from canonically named tensors (split_tensors' vision side)."""
        load_parameters(self.hf_parameters(), tensors, dtype)


def _norm_parameters(norm: nnx.Module, name: str) -> Iterator[VisionParameter]:
    """A LayerNorm's weight and bias, or an RMSNorm's weight."""
    yield norm.weight, name + ".weight", False
    if hasattr(norm, "bias"):
        yield norm.bias, name + ".bias", False


def vision_rotary_positions(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """[grid_h * grid_w, 2] int32 (row, col) of each patch of one image in the processor's order: merge x merge
    blocks in row-major order, each block's patches row-major."""
    if grid_h % merge or grid_w % merge:
        raise ValueError(f"patch grid {grid_h}x{grid_w} is not a multiple of the merge size {merge}")
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")  # [h, w] each

    def block_major(a: np.ndarray) -> np.ndarray:  # [h, w] -> [h * w]
        return a.reshape(grid_h // merge, merge, grid_w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    return np.stack([block_major(rows), block_major(cols)], axis=-1).astype(np.int32)


def split_tensors(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """-> (the vision tower's tensors under 'visual.', the language model's under 'model.' / 'lm_head.')."""
    return vision_weights.split_tensors(tensors, _PREFIXES)
