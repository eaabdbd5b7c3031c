"""Vision-language checkpoints (LLaVA): the vision side's module and weights, the image processor, and the
language model's config and tensors, which load like any decoder's."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from flax import nnx

from models.llava import LlavaConfig, LlavaVision

logger = logging.getLogger("jvllm")

VISION_LANGUAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",)


@dataclasses.dataclass
class VisionModel:
    """The vision side of a loaded vision-language model."""

    config: LlavaConfig
    graphdef: Any
    state: Any
    image_processor: Any  # a transformers image processor on its PIL backend (numpy out, no torch)
    image_token: str  # the placeholder text of one image in a prompt, e.g. "<image>"

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image


def is_vision_language(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("architectures") or [""])[0] in VISION_LANGUAGE_ARCHITECTURES


def complete_config(folder: Path) -> dict[str, Any]:
    """The config with every nested default filled in (LLaVA configs often list only what differs from the
    defaults of their text and vision configs), through transformers' config classes (no torch)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder)).to_dict()


def load_vision(folder: Path, hf_config: dict[str, Any], tokenizer: Any, dtype: Any, tensors: dict | None,
                seed: int) -> VisionModel:
    """The vision module with its weights from `tensors` (canonical names; None: random weights)."""
    config = LlavaConfig.from_hf_dict(hf_config)
    if tensors is None:
        module = LlavaVision(config, dtype, nnx.Rngs(seed + 1))
    else:
        module = nnx.eval_shape(lambda: LlavaVision(config, dtype, None))
        module.load_hf_weights(tensors, dtype)
    graphdef, state = nnx.split(module)
    token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    if not isinstance(token, str):
        raise ValueError(f"the tokenizer has no token for the image token id {config.image_token_id}")
    return VisionModel(config, graphdef, state, image_processor(folder, config), token)


def image_processor(folder: Path, config: LlavaConfig) -> Any:
    """The folder's image processor (preprocessor_config.json) on the PIL backend; without one, CLIP's
    resize-and-crop to the tower's input size."""
    from transformers import AutoImageProcessor, CLIPImageProcessorPil

    if (folder / "preprocessor_config.json").is_file():
        return AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    size = config.vision.image_size
    logger.warning("%s has no preprocessor_config.json: images are resized and cropped to %dx%d as CLIP's "
                   "processor does", folder, size, size)
    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
