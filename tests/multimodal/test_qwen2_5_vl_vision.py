"""Qwen2.5-VL vision tower parity with transformers (PyTorch, float32): window and full attention over one image and
over several packed images with padding rows, the window partition, checkpoint namings and config errors."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from models.qwen2_5_vl import (  # noqa: E402
    Qwen25VisionConfig, Qwen25VisionTower, Qwen25VLConfig, split_tensors, text_config_dict,
)
from models.qwen2_vl import vision_rotary_positions  # noqa: E402
from tests.multimodal.helpers import random_image  # noqa: E402
from tests.multimodal.qwen2_vl_helpers import (  # noqa: E402
    hf_image_features, load_tower, newer_checkpoint_name, packed_features, processed_images,
)

FEATURES_ATOL = 1e-4  # features reach |x| ~ 3; measured max difference ~3e-6
# (height, width) -> patch grids 4x6 (two window columns, the second partial), 6x10 (2 x 3 windows, partial ones at
# the bottom and right), 4x4 (28 x 28 upscaled to min_pixels: one window).
SIZES = [(56, 84), (84, 140), (28, 28)]
# Full attention in every block instead (windows ignored) must miss transformers by far more than FEATURES_ATOL
# (measured ~0.3).
WINDOWS_MATTER = 100 * FEATURES_ATOL


@pytest.fixture(scope="module")
def hf_config(tiny_qwen2_5_vl) -> dict:
    import transformers

    return transformers.AutoConfig.from_pretrained(str(tiny_qwen2_5_vl[0])).to_dict()


@pytest.fixture(scope="module")
def tensors(tiny_qwen2_5_vl) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(tiny_qwen2_5_vl[0] / "model.safetensors"))


@pytest.fixture(scope="module")
def image_processor(tiny_qwen2_5_vl):
    import transformers

    return transformers.AutoImageProcessor.from_pretrained(str(tiny_qwen2_5_vl[0]), backend="pil")


@pytest.fixture(scope="module")
def tower(hf_config, tensors) -> Qwen25VisionTower:
    return load_tower(Qwen25VisionTower, Qwen25VisionConfig.from_hf_dict(hf_config["vision_config"]),
                      split_tensors(tensors)[0])


def _max_difference(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    assert [g.shape for g in got] == [w.shape for w in want]
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def test_one_image_matches_transformers(tiny_qwen2_5_vl, tower, image_processor):
    model = tiny_qwen2_5_vl[1]
    pixels, grids = processed_images(image_processor, [random_image(0, SIZES[1])])
    assert grids.tolist() == [[1, 6, 10]]
    got, want = packed_features(tower, pixels, grids, len(pixels)), hf_image_features(model, pixels, grids)
    assert got[0].shape == (15, 64)
    print(f"one image: max |jax - torch| = {_max_difference(got, want):.2e}, max |torch| = {np.abs(want[0]).max():.2f}")
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=FEATURES_ATOL)


def test_packed_images_with_padding_match_transformers(tiny_qwen2_5_vl, tower, image_processor, hf_config, tensors):
    model = tiny_qwen2_5_vl[1]
    pixels, grids = processed_images(image_processor, [random_image(seed, size) for seed, size in enumerate(SIZES)])
    assert grids.tolist() == [[1, 4, 6], [1, 6, 10], [1, 4, 4]] and len(pixels) == 100
    got = packed_features(tower, pixels, grids, padded_len=128)  # 28 padding rows
    want = hf_image_features(model, pixels, grids)
    assert [g.shape for g in got] == [(6, 64), (15, 64), (4, 64)]
    print(f"three packed images: max |jax - torch| = {_max_difference(got, want):.2e}")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=FEATURES_ATOL)

    cfg = Qwen25VisionConfig.from_hf_dict(hf_config["vision_config"])
    everywhere = dataclasses.replace(cfg, fullatt_block_indexes=tuple(range(cfg.depth)))
    full_tower = load_tower(Qwen25VisionTower, everywhere, split_tensors(tensors)[0])
    full = packed_features(full_tower, pixels, grids, padded_len=128)
    print(f"full attention in every block: max |jax - torch| = {_max_difference(full, want):.2e}")
    assert _max_difference(full, want) > WINDOWS_MATTER
    assert float(np.abs(full[2] - want[2]).max()) < FEATURES_ATOL  # the 4x4 image is one window: no change there


@pytest.mark.parametrize("grid", [(4, 6), (6, 10), (4, 4), (8, 8), (16, 22)])
@pytest.mark.parametrize("window_size", [56, 112])
def test_windows_match_transformers(grid, window_size):
    """Windows of (row // window_patches, col // window_patches) group the merged tokens as get_vision_window_index."""
    from transformers.vision_utils import get_vision_window_index

    from tests.multimodal.qwen2_vl_helpers import QWEN25VL_VISION

    cfg = Qwen25VisionConfig.from_hf_dict({**QWEN25VL_VISION, "window_size": window_size})
    window_index, cu_seqlens = get_vision_window_index(torch.tensor([[1, *grid]]), cfg.spatial_merge_size,
                                                       window_size, cfg.patch_size)
    bounds = cu_seqlens.numpy() // cfg.merge_unit
    want = {frozenset(window_index[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])}
    merged = vision_rotary_positions(*grid, merge=cfg.spatial_merge_size)[::cfg.merge_unit]  # each token's 1st patch
    windows = [tuple(rc) for rc in merged // cfg.window_patches]
    got = {frozenset(i for i, w in enumerate(windows) if w == key) for key in set(windows)}
    assert got == want


def test_checkpoints_with_either_naming_load_the_same(tensors, hf_config, tower, image_processor):
    """transformers saves Qwen2.5-VL with the older names (visual.*, model.layers.*, lm_head.*); checkpoints written
    with the >= 4.52 names (model.visual.*, model.language_model.*, lm_head.*) split to the same tensors, and a tower
    loads the same from either."""
    assert "visual.patch_embed.proj.weight" in tensors and "model.embed_tokens.weight" in tensors

    old, new = tensors, {newer_checkpoint_name(k): v for k, v in tensors.items()}
    (old_vision, old_text), (new_vision, new_text) = split_tensors(old), split_tensors(new)
    assert sorted(old_vision) == sorted(new_vision) and sorted(old_text) == sorted(new_text)
    assert len(old_vision) + len(old_text) == len(tensors) and "lm_head.weight" in old_text
    assert all(name.startswith("visual.") for name in old_vision)
    assert len(old_vision) == len(list(tower.hf_parameters()))  # every vision tensor is used
    pixels, grids = processed_images(image_processor, [random_image(3, SIZES[0])])
    cfg = Qwen25VisionConfig.from_hf_dict(hf_config["vision_config"])
    outputs = [packed_features(load_tower(Qwen25VisionTower, cfg, vision), pixels, grids, len(pixels))[0]
               for vision in (old_vision, new_vision)]
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_config(hf_config):
    cfg = Qwen25VLConfig.from_hf_dict(hf_config)
    vision = cfg.vision
    assert (vision.head_dim, vision.patch_dim, vision.merge_unit, vision.window_patches) == (8, 1176, 4, 4)
    assert (vision.fullatt_block_indexes, vision.hidden_act, vision.rope_theta) == ((1, 3), "silu", 10000.0)
    assert cfg.text_hidden_size == 64 and cfg.image_token_id == 49154 and cfg.vision_start_token_id == 49152
    text = text_config_dict(hf_config)
    assert text["architectures"] == ["Qwen2ForCausalLM"]
    assert text["rope_parameters"]["mrope_section"] == [2, 3, 3]


def test_config_and_weight_errors(hf_config):
    import jax.numpy as jnp
    from flax import nnx

    vision = hf_config["vision_config"]
    with pytest.raises(ValueError, match="hidden_act 'mish'"):
        Qwen25VisionConfig.from_hf_dict({**vision, "hidden_act": "mish"})
    with pytest.raises(ValueError, match="window_size 20"):
        Qwen25VisionConfig.from_hf_dict({**vision, "window_size": 20})
    with pytest.raises(ValueError, match="unsupported vision tower 'qwen2_vl_vision'"):
        Qwen25VisionConfig.from_hf_dict({**vision, "model_type": "qwen2_vl_vision"})
    with pytest.raises(ValueError, match="output width 48"):
        Qwen25VLConfig.from_hf_dict({**hf_config, "vision_config": {**vision, "out_hidden_size": 48}})
    module = nnx.eval_shape(lambda: Qwen25VisionTower(Qwen25VisionConfig.from_hf_dict(vision), jnp.float32,
                                                      nnx.Rngs(0)))
    with pytest.raises(ValueError, match="visual.patch_embed.proj.weight"):
        module.load_hf_weights({}, jnp.float32)
