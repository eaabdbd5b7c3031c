"""Test helpers: tiny random Qwen2-VL and Qwen2.5-VL models saved with transformers, their tokenizer (SmolLM2's plus
the vision tokens), PIL image processor and transformers' Qwen2VLProcessor over them, and the vision towers' features
on both sides (Flax, packed; transformers, per image)."""
from __future__ import annotations

import pathlib

import numpy as np

VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID = 49152, 49153, 49154
VIDEO_PAD_ID = 49155  # no such token in the tokenizer: the config needs an id, the tests send no video
QWEN2VL_TEXT = dict(vocab_size=49156, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
QWEN2VL_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
# Qwen2.5-VL: 4 blocks, 1 and 3 attending over the whole image, 0 and 2 within windows of 56 pixels = 4 x 4 patches
# (2 x 2 merged tokens).
QWEN25VL_VISION = dict(depth=4, fullatt_block_indexes=[1, 3], hidden_size=32, intermediate_size=64, out_hidden_size=64,
                       num_heads=4, hidden_act="silu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=56, in_channels=3)
# Resized images hold 2x2 to 4x4 merged tokens (28 x 28 pixels each): 4 to 16 image tokens per image.
IMAGE_PROCESSOR = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                       temporal_patch_size=2)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a prompt, as Qwen2-VL's template writes it
MAX_TOKENS = 32  # new tokens in the engine tests' greedy comparisons


def qwen2_vl_tokenizer():
    """SmolLM2's tokenizer (rebuilt from the default model's GGUF) plus Qwen2-VL's vision tokens."""
    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.gguf import gguf_tokenizer

    tokenizer = gguf_tokenizer(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]})
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    assert ids == [VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID], ids
    return tokenizer


def build_qwen2_vl(folder: pathlib.Path, tokenizer):
    """Save a tiny random Qwen2VLForConditionalGeneration (weights redrawn large, see tests/hf_weights.py), the
    tokenizer and a PIL Qwen2-VL image processor config into `folder`; -> the transformers model (float32, eval)."""
    return _build(folder, tokenizer, "Qwen2VL", QWEN2VL_VISION)


def build_qwen2_5_vl(folder: pathlib.Path, tokenizer):
    """The same for Qwen2_5_VLForConditionalGeneration (which uses Qwen2-VL's image processor)."""
    return _build(folder, tokenizer, "Qwen2_5_VL", QWEN25VL_VISION)


def _build(folder: pathlib.Path, tokenizer, family: str, vision: dict):
    import torch
    import transformers

    from tests.hf_weights import redraw_weights

    config = getattr(transformers, f"{family}Config")(
        text_config=QWEN2VL_TEXT, vision_config=vision, image_token_id=IMAGE_PAD_ID, video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    redraw_weights(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformers.Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(folder)
    loaded = transformers.AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    assert isinstance(loaded, transformers.Qwen2VLImageProcessorPil), type(loaded)
    return model


def qwen2_vl_hf_processor(folder: pathlib.Path, tokenizer):
    """transformers' Qwen2VLProcessor over the folder's image processor (PIL backend) and the tokenizer: each
    `<|image_pad|>` in the text becomes one per merged token of its image."""
    import transformers

    class ImageOnlyProcessor(transformers.Qwen2VLProcessor):
        """Without torchvision transformers has no video processor class to check a None video_processor against."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    image_processor = transformers.AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    processor = ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)
    assert processor.image_token == "<|image_pad|>" and processor.image_token_id == IMAGE_PAD_ID
    return processor


def newer_checkpoint_name(name: str) -> str:
    """A tensor name as transformers >= 4.52 writes it (model.visual.*, model.language_model.*) from the older layout
    that save_pretrained still writes for the Qwen-VL families (visual.*, model.*)."""
    if name.startswith("visual."):
        return "model." + name
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def processed_images(image_processor, images: list) -> tuple[np.ndarray, np.ndarray]:
    """The image processor's (pixel_values [P, patch_dim], image_grid_thw [N, 3])."""
    out = image_processor(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"])


def hf_image_features(model, pixels: np.ndarray, grids: np.ndarray) -> list[np.ndarray]:
    """transformers' merged features of each image."""
    import torch

    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids))
    return [features.numpy() for features in out.pooler_output]


def load_tower(tower_cls, cfg, vision_tensors: dict[str, np.ndarray]):
    """A Flax tower of `cfg` with the given canonically named weights (float32)."""
    import jax.numpy as jnp
    from flax import nnx

    module = nnx.eval_shape(lambda: tower_cls(cfg, jnp.float32, nnx.Rngs(0)))
    module.load_hf_weights(vision_tensors, jnp.float32)
    return module


def packed_features(tower, pixels: np.ndarray, grids: np.ndarray, padded_len: int) -> list[np.ndarray]:
    """Every image's patches in one call of the Flax tower, padded to `padded_len` rows -> each image's features."""
    import jax.numpy as jnp

    from models.qwen2_vl import vision_rotary_positions

    cfg = tower.config
    positions = np.concatenate([vision_rotary_positions(int(h), int(w), cfg.spatial_merge_size) for _, h, w in grids])
    segments = np.concatenate([np.full(t * h * w, i, np.int32) for i, (t, h, w) in enumerate(grids)])
    pad = padded_len - len(pixels)
    pixels = np.concatenate([pixels, np.zeros((pad, pixels.shape[1]), np.float32)])
    positions = np.concatenate([positions, np.zeros((pad, 2), np.int32)])
    segments = np.concatenate([segments, np.full(pad, -1, np.int32)])
    out = np.asarray(tower(jnp.asarray(pixels), jnp.asarray(positions), jnp.asarray(segments)))
    assert out.shape == (padded_len // cfg.merge_unit, cfg.out_hidden_size)
    assert np.isfinite(out).all()  # the padding rows' tokens too
    bounds = np.cumsum([0] + [int(np.prod(g)) // cfg.merge_unit for g in grids])
    return [out[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
