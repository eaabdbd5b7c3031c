"""Qwen2-VL vision tower parity with transformers (PyTorch, float32): one image, several images packed into one call
with padding rows, the rotary positions, and checkpoints under both of transformers' naming schemes."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from models.qwen2_vl import (  # noqa: E402
    Qwen2VisionConfig, Qwen2VisionTower, split_tensors, vision_rotary_positions,
)
from tests.multimodal.helpers import random_image  # noqa: E402
from tests.multimodal.qwen2_vl_helpers import (  # noqa: E402
    hf_image_features, load_tower, newer_checkpoint_name, packed_features, processed_images, qwen2_vl_hf_processor,
)

FEATURES_ATOL = 1e-4  # features reach |x| ~ 3.3; measured max difference ~2e-6
SIZES = [(56, 84), (28, 28), (90, 60)]  # -> patch grids 4x6, 4x4 (upscaled to min_pixels), 6x4


@pytest.fixture(scope="module")
def processor(tiny_qwen2_vl, qwen2_vl_tok):
    return qwen2_vl_hf_processor(tiny_qwen2_vl[0], qwen2_vl_tok)


@pytest.fixture(scope="module")
def tower(tiny_qwen2_vl):
    """The Flax tower with the saved checkpoint's weights (float32)."""
    import transformers
    from safetensors.numpy import load_file

    folder = tiny_qwen2_vl[0]
    hf = transformers.AutoConfig.from_pretrained(str(folder)).to_dict()
    cfg = Qwen2VisionConfig.from_hf_dict(hf["vision_config"])
    return load_tower(Qwen2VisionTower, cfg, split_tensors(load_file(str(folder / "model.safetensors")))[0])


def test_one_image_matches_transformers(tiny_qwen2_vl, tower, processor):
    model = tiny_qwen2_vl[1]
    pixels, grids = processed_images(processor.image_processor, [random_image(0, SIZES[0])])
    assert grids.tolist() == [[1, 4, 6]]
    (got,), (want,) = packed_features(tower, pixels, grids, len(pixels)), hf_image_features(model, pixels, grids)
    assert got.shape == want.shape == (6, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=FEATURES_ATOL)


def test_packed_images_with_padding_match_transformers(tiny_qwen2_vl, tower, processor):
    model = tiny_qwen2_vl[1]
    pictures = [random_image(seed, size) for seed, size in enumerate(SIZES)]
    pixels, grids = processed_images(processor.image_processor, pictures)
    assert grids.tolist() == [[1, 4, 6], [1, 4, 4], [1, 6, 4]] and len(pixels) == 64
    got = packed_features(tower, pixels, grids, padded_len=128)  # 64 padding rows
    want = hf_image_features(model, pixels, grids)
    assert [g.shape for g in got] == [w.shape for w in want] == [(6, 64), (4, 64), (6, 64)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=FEATURES_ATOL)


@pytest.mark.parametrize("grid", [(4, 6), (2, 2), (8, 4)])
def test_rotary_positions_match_transformers(grid):
    from transformers.vision_utils import get_vision_position_ids

    want = get_vision_position_ids(torch.tensor([[1, *grid]]), 2).numpy()
    got = vision_rotary_positions(*grid, merge=2)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_checkpoints_with_either_naming_load_the_same(tiny_qwen2_vl):
    """transformers saves Qwen2-VL with the older names (visual.*, model.layers.*, lm_head.*); checkpoints written
    with the >= 4.52 names (model.visual.*, model.language_model.*, lm_head.*) split to the same tensors."""
    from safetensors.numpy import load_file

    tensors = load_file(str(tiny_qwen2_vl[0] / "model.safetensors"))
    assert "visual.patch_embed.proj.weight" in tensors and "model.embed_tokens.weight" in tensors

    old_vision, old_text = split_tensors(tensors)
    new_vision, new_text = split_tensors({newer_checkpoint_name(k): v for k, v in tensors.items()})
    assert sorted(old_vision) == sorted(new_vision) and sorted(old_text) == sorted(new_text)
    assert len(old_vision) + len(old_text) == len(tensors) and "lm_head.weight" in old_text
    assert all(name.startswith("visual.") for name in old_vision)
    for old, new in ((old_vision, new_vision), (old_text, new_text)):
        for name in old:
            assert old[name] is new[name]


def test_config_and_weight_errors(tiny_qwen2_vl):
    import jax.numpy as jnp
    import transformers
    from flax import nnx

    hf = transformers.AutoConfig.from_pretrained(str(tiny_qwen2_vl[0])).to_dict()["vision_config"]
    cfg = Qwen2VisionConfig.from_hf_dict(hf)
    assert (cfg.head_dim, cfg.patch_dim, cfg.merge_unit, cfg.mlp_dim, cfg.rope_theta) == (8, 1176, 4, 64, 10000.0)
    with pytest.raises(ValueError, match="hidden_act 'mish'"):
        Qwen2VisionConfig.from_hf_dict({**hf, "hidden_act": "mish"})
    module = nnx.eval_shape(lambda: Qwen2VisionTower(cfg, jnp.float32, nnx.Rngs(0)))
    with pytest.raises(ValueError, match="visual.patch_embed.proj.weight"):
        module.load_hf_weights({}, jnp.float32)
