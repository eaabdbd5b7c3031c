"""LLaVA-1.5's vision side in Flax NNX: the CLIP tower's selected hidden states through the two-layer MLP projector,
giving the language model one embedding row per image token. The language model itself is a Llama-family decoder
(models.llama) loaded from the same checkpoint."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bert import Dense
from models import vision_weights
from models.clip import ACTIVATIONS, ClipVisionConfig, ClipVisionTower, dense_parameters
from models.vision_weights import VisionParameter, load_parameters

# Text model_type of a LLaVA checkpoint -> the architecture jvllm serves it as.
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Checkpoint name prefixes -> canonical ones: transformers < 4.52 and >= 4.52 name LLaVA's parts differently, and
# older CLIP towers keep a `vision_model.` level.
_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."), ("multi_modal_projector.", "multi_modal_projector."),
    ("language_model.model.", "model."), ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
)


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    """What the vision side needs of a `LlavaForConditionalGeneration` config."""

    vision: ClipVisionConfig
    text_hidden_size: int
    feature_layers: tuple[int, ...]  # hidden-state indices (0: the embeddings' output), concatenated in this order
    select_strategy: str  # "default" drops the class token's row, "full" keeps it
    projector_act: str
    projector_bias: bool
    image_token_id: int

    @property
    def tokens_per_image(self) -> int:
        """Image tokens of one image in the prompt (LLaVA-1.5: one per patch)."""
        return self.vision.num_patches + (0 if self.select_strategy == "default" else 1)

    @property
    def tower_layers(self) -> int:
        """Encoder layers computed: up to the deepest selected hidden state."""
        return max(self.feature_layers)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "LlavaConfig":
        """From a complete config dict (transformers' LlavaConfig.to_dict(): nested configs with their defaults)."""
        vision = ClipVisionConfig.from_hf_dict(hf["vision_config"])
        layers = hf.get("vision_feature_layer", -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        states = vision.num_layers + 1  # the embeddings' output, then one per layer
        resolved = tuple(layer % states for layer in layers)
        strategy = hf.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: default, full")
        act = hf.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        token = hf.get("image_token_index", hf.get("image_token_id"))
        return cls(vision=vision, text_hidden_size=int(hf["text_config"]["hidden_size"]), feature_layers=resolved,
                   select_strategy=strategy, projector_act=act,
                   projector_bias=bool(hf.get("multimodal_projector_bias", True)), image_token_id=int(token))


def text_config_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config dict, with the architecture jvllm serves it as."""
    text = dict(hf["text_config"])
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(f"unsupported LLaVA language model {model_type!r}; supported: {', '.join(TEXT_ARCHITECTURES)}")
    text["architectures"] = [TEXT_ARCHITECTURES[model_type]]
    if text.get("eos_token_id") is None and hf.get("eos_token_id") is not None:
        text["eos_token_id"] = hf["eos_token_id"]
    return text


class LlavaProjector(nnx.Module):
    """linear_2(act(linear_1(features))): vision width (times the feature layers) -> the text model's width."""

    def __init__(self, d_in: int, d_out: int, act: str, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.linear_1, self.linear_2 = Dense(d_in, d_out, dtype, rngs), Dense(d_out, d_out, dtype, rngs)
        self.act_name, self.has_bias = act, bias  # without biases in the checkpoint, they are zeros (exact)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(ACTIVATIONS[self.act_name](self.linear_1(x)))


class LlavaVision(nnx.Module):
    """pixel_values [B, C, H, W] -> image features [B, tokens_per_image, text hidden], what replaces the image
    tokens' embeddings."""

    def __init__(self, cfg: LlavaConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.config = cfg
        self.vision_tower = ClipVisionTower(cfg.vision, cfg.tower_layers, dtype, rngs)
        width = cfg.vision.hidden_size * len(cfg.feature_layers)
        self.multi_modal_projector = LlavaProjector(width, cfg.text_hidden_size, cfg.projector_act,
                                                    cfg.projector_bias, dtype, rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        states = self.vision_tower.hidden_states(pixel_values)
        selected = [states[i] for i in self.config.feature_layers]  # [B, 1 + patches, Dv] each
        if self.config.select_strategy == "default":
            selected = [s[:, 1:] for s in selected]
        features = selected[0] if len(selected) == 1 else jnp.concatenate(selected, axis=-1)
        return self.multi_modal_projector(features)

    def hf_parameters(self) -> Iterator[VisionParameter]:
        yield from self.vision_tower.hf_parameters("vision_tower.")
        projector = self.multi_modal_projector
        for name in ("linear_1", "linear_2"):
            params = list(dense_parameters(getattr(projector, name), f"multi_modal_projector.{name}"))
            yield from params if projector.has_bias else params[:1]

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
        """Fill every parameter from canonically named tensors (split_tensors' vision side)."""
        load_parameters(self.hf_parameters(), tensors, dtype)
        if not self.multi_modal_projector.has_bias:
            for name in ("linear_1", "linear_2"):
                dense: Dense = getattr(self.multi_modal_projector, name)
                dense.bias.set_value(jnp.zeros(dense.bias.shape, dtype))


def split_tensors(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """-> (the vision side's tensors under 'vision_tower.' and 'multi_modal_projector.', the language model's
    tensors under Llama's names)."""
    return vision_weights.split_tensors(tensors, _PREFIXES)
