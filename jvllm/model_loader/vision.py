"""Vision-language checkpoints (LLaVA-1.5, Qwen2-VL, Qwen2.5-VL): the vision side's module and weights, the image
processor, and the language model's config and tensors, which load like any decoder's."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from flax import nnx

from models import llava, qwen2_5_vl, qwen2_vl
from models.llava import LlavaConfig, LlavaVision
from models.qwen2_5_vl import Qwen25VLConfig
from models.qwen2_vl import Qwen2VLConfig

logger = logging.getLogger("jvllm")

# Qwen-VL architectures -> (config, vision tower, checkpoint splitter); their images are processed alike.
_QWEN_VL = {"Qwen2VLForConditionalGeneration": (Qwen2VLConfig, qwen2_vl.Qwen2VisionTower, qwen2_vl.split_tensors),
            "Qwen2_5_VLForConditionalGeneration": (Qwen25VLConfig, qwen2_5_vl.Qwen25VisionTower,
                                                   qwen2_5_vl.split_tensors)}
VISION_LANGUAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", *_QWEN_VL)
# Qwen2-VL encodes an image in one step with dense attention over its patches: larger images are resized down to
# this many tokens (vLLM's examples use the same bound, max_pixels = 1280 * 28 * 28).
DEFAULT_MAX_IMAGE_TOKENS = 1280


@dataclasses.dataclass
class VisionModel:
    """The vision side of a loaded vision-language model."""

    config: LlavaConfig | Qwen2VLConfig | Qwen25VLConfig
    graphdef: Any
    state: Any
    image_processor: Any  # a transformers image processor on its PIL backend (numpy out, no torch)
    image_token: str  # the placeholder text of one image in a prompt, e.g. "<image>"
    max_image_tokens: int  # the most tokens one image may take
    processor_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # passed on every processor call

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def tokens_per_image(self) -> int | None:
        """Every image's token count (LLaVA), or None where it follows the image's size (Qwen2-VL)."""
        return self.config.tokens_per_image if isinstance(self.config, LlavaConfig) else None

    def input_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The encoder input's shape for an image of `num_tokens` tokens."""
        if isinstance(self.config, LlavaConfig):
            cfg = self.config.vision
            return cfg.num_channels, cfg.image_size, cfg.image_size
        cfg = self.config.vision
        return num_tokens * cfg.merge_unit, cfg.patch_dim


def is_vision_language(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("architectures") or [""])[0] in VISION_LANGUAGE_ARCHITECTURES


def qwen_vl_parts(hf_config: dict[str, Any]) -> tuple | None:
    """A Qwen-VL checkpoint's (config class, vision tower class, checkpoint splitter); None for LLaVA."""
    return _QWEN_VL.get((hf_config.get("architectures") or [""])[0])


def complete_config(folder: Path) -> dict[str, Any]:
    """The config with every nested default filled in (vision-language configs often list only what differs from
    the defaults of their text and vision configs), through transformers' config classes (no torch)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder)).to_dict()


def split_tensors(hf: dict[str, Any], tensors: dict) -> tuple[dict, dict]:
    """-> (the vision side's tensors, the language model's tensors under Llama's names)."""
    parts = qwen_vl_parts(hf)
    return llava.split_tensors(tensors) if parts is None else parts[2](tensors)


def load_vision(folder: Path, hf_config: dict[str, Any], tokenizer: Any, dtype: Any, tensors: dict | None,
                seed: int, mm_processor_kwargs: dict[str, Any] | None = None) -> VisionModel:
    """The vision module with its weights from `tensors` (canonical names; None: random weights).
    `mm_processor_kwargs` (vLLM's): Qwen2-VL takes `min_pixels` and `max_pixels`, LLaVA nothing."""
    parts = qwen_vl_parts(hf_config)
    qwen = parts is not None
    config = parts[0].from_hf_dict(hf_config) if qwen else LlavaConfig.from_hf_dict(hf_config)
    build = (lambda rngs: parts[1](config.vision, dtype, rngs)) if qwen else (
        lambda rngs: LlavaVision(config, dtype, rngs))
    if tensors is None:
        module = build(nnx.Rngs(seed + 1))
    else:
        module = nnx.eval_shape(lambda: build(None))
        module.load_hf_weights(tensors, dtype)
    graphdef, state = nnx.split(module)
    token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    if not isinstance(token, str):
        raise ValueError(f"the tokenizer has no token for the image token id {config.image_token_id}")
    settings = dict(mm_processor_kwargs or {})
    supported = ("min_pixels", "max_pixels") if qwen else ()
    unknown = sorted(set(settings) - set(supported))
    if unknown:
        raise ValueError(f"mm_processor_kwargs: unsupported key {unknown[0]!r} for {hf_config['architectures'][0]}; "
                         f"supported: {', '.join(supported) or 'none'}")
    if not qwen:
        return VisionModel(config, graphdef, state, clip_image_processor(folder, config), token,
                           config.tokens_per_image)
    processor, max_tokens, kwargs = qwen2_vl_image_processor(folder, config, **settings)
    start, end = (tokenizer.convert_ids_to_tokens(i) for i in (config.vision_start_token_id,
                                                                 config.vision_end_token_id))
    placeholder = f"{start}{token}{end}" if isinstance(start, str) and isinstance(end, str) else token
    return VisionModel(config, graphdef, state, processor, placeholder, max_tokens, kwargs)


def clip_image_processor(folder: Path, config: LlavaConfig) -> Any:
    """The folder's image processor (preprocessor_config.json) on the PIL backend; without one, CLIP's
    resize-and-crop to the tower's input size."""
    from transformers import AutoImageProcessor, CLIPImageProcessorPil

    if (folder / "preprocessor_config.json").is_file():
        return AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    size = config.vision.image_size
    logger.warning("%s has no preprocessor_config.json: images are resized and cropped to %dx%d as CLIP's "
                   "processor does", folder, size, size)
    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def qwen2_vl_image_processor(folder: Path, config: Qwen2VLConfig | Qwen25VLConfig, min_pixels: int | None = None,
                             max_pixels: int | None = None) -> tuple[Any, int, dict[str, Any]]:
    """-> (the folder's Qwen2-VL image processor (Qwen2.5-VL's too) on the PIL backend, the most tokens an image may
    take, the size bounds to call it with). `min_pixels` / `max_pixels` replace the processor's bounds; without
    `max_pixels`, images the processor would leave larger than DEFAULT_MAX_IMAGE_TOKENS are resized down to it."""
    from transformers import AutoImageProcessor, Qwen2VLImageProcessorPil

    vision = config.vision
    if (folder / "preprocessor_config.json").is_file():
        processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    else:
        logger.warning("%s has no preprocessor_config.json: images are processed with Qwen2-VL's defaults", folder)
        processor = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                             temporal_patch_size=vision.temporal_patch_size)
    geometry = (processor.patch_size, processor.merge_size, processor.temporal_patch_size)
    if geometry != (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
        raise ValueError(f"the image processor's patch, merge and temporal sizes {geometry} do not match the "
                         f"vision config's")
    token_pixels = (vision.patch_size * vision.spatial_merge_size) ** 2
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < token_pixels):
            raise ValueError(f"mm_processor_kwargs: {name} must be an integer of at least {token_pixels} (one "
                             f"image token), got {value!r}")
    explicit_max = max_pixels is not None
    min_pixels = int(processor.size["shortest_edge"]) if min_pixels is None else min_pixels
    max_pixels = int(processor.size["longest_edge"]) if max_pixels is None else max_pixels
    if min_pixels > max_pixels:
        raise ValueError(f"mm_processor_kwargs: min_pixels {min_pixels} exceeds max_pixels {max_pixels}")
    max_tokens = max_pixels // token_pixels
    if max_tokens > DEFAULT_MAX_IMAGE_TOKENS and not explicit_max:
        logger.info("images larger than %d tokens (%d pixels) are resized down to it", DEFAULT_MAX_IMAGE_TOKENS,
                    DEFAULT_MAX_IMAGE_TOKENS * token_pixels)
        max_tokens, max_pixels = DEFAULT_MAX_IMAGE_TOKENS, DEFAULT_MAX_IMAGE_TOKENS * token_pixels
    return processor, max_tokens, {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}
