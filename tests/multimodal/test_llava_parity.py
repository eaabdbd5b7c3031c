"""LLaVA-1.5 model parity with transformers (PyTorch, float32), module by module: the vision side's features (CLIP
tower, feature layer selection, select strategy, projector) and the full logits of prompts with images, from
checkpoints under both of transformers' naming schemes."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jvllm import Engine  # noqa: E402
from jvllm.model_loader.loader import load_model  # noqa: E402
from tests.multimodal.helpers import hf_inputs, hf_logits, hf_processor  # noqa: E402
from tests.prompt_logits import prompt_logits  # noqa: E402

FEATURES_ATOL = 1e-4  # features reach |x| ~ 10; measured max difference ~7e-6
LOGITS_ATOL = 1e-4  # measured ~1e-5
VARIANTS = {
    "base": {},  # vision_feature_layer -2, "default" (class token dropped), projector with biases
    "full_two_layers": dict(vision_feature_layer=[0, -1], vision_feature_select_strategy="full"),
    "no_projector_bias": dict(multimodal_projector_bias=False, vision_feature_layer=1,
                              vision={"hidden_act": "gelu"}),
}


def _vision_features(folder, pixels: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp
    from flax import nnx

    vision = load_model(str(folder), dtype="float32").vision
    return np.asarray(nnx.merge(vision.graphdef, vision.state)(jnp.asarray(pixels)))


def _hf_features(model, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=torch.tensor(pixels))
    return torch.stack(list(out.pooler_output)).numpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_vision_features_match_transformers(name, make_llava):
    overrides = dict(VARIANTS[name])
    folder, model = make_llava(name, **overrides)
    pixels = np.random.RandomState(0).randn(3, 3, 28, 28).astype(np.float32)
    got, want = _vision_features(folder, pixels), _hf_features(model, pixels)
    expected_tokens = 17 if overrides.get("vision_feature_select_strategy") == "full" else 16
    assert got.shape == want.shape == (3, expected_tokens, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=FEATURES_ATOL)


@pytest.mark.parametrize("name, num_images", [("base", 2), ("full_two_layers", 1), ("no_projector_bias", 3)])
def test_prompt_logits_with_images_match_transformers(name, num_images, make_llava, llava_tokenizer, images):
    folder, model = make_llava(name, **VARIANTS[name])
    engine = Engine(str(folder), dtype="float32", precompile=False, kv_cache_memory_bytes=8 << 20)
    text = "A picture: <image> and" + " then <image>" * (num_images - 1) + " so what do you see?"
    inputs = hf_inputs(hf_processor(folder, llava_tokenizer, model), text, images[:num_images])
    want_ids = inputs["input_ids"][0].tolist()
    ids, items = engine.mm_processor.expand(llava_tokenizer.encode(text), {"image": images[:num_images]})
    assert ids == want_ids  # placeholders expanded exactly as LlavaProcessor does
    assert [item.offset for item in items] == [i for i, t in enumerate(ids) if t == 49152][::items[0].length]
    np.testing.assert_allclose(np.stack([item.data for item in items]), inputs["pixel_values"].numpy(), atol=0)
    got = prompt_logits(engine.runner, ids, items, engine.encoder_cache)
    want = hf_logits(model, inputs)
    assert got.shape == want.shape == (len(ids), 49153)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)


def test_checkpoints_with_the_newer_names_load_the_same(make_llava, tmp_path):
    """transformers 4.52+ checkpoints name the parts model.vision_tower.vision_model.*, model.multi_modal_projector.*,
    model.language_model.* and lm_head.*; the tiny model was saved with the older names (language_model.model.*,
    vision_tower.*): both load to the same weights."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, model = make_llava("base")
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower.vision_model."),
               ("multi_modal_projector.", "model.multi_modal_projector."))
    tensors = load_file(str(folder / "model.safetensors"))
    assert any(name.startswith("language_model.model.") for name in tensors)

    def rename(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old):]
        raise AssertionError(f"unexpected tensor {name}")

    for item in folder.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, tmp_path / item.name)
    save_file({rename(k): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    pixels = np.random.RandomState(1).randn(1, 3, 28, 28).astype(np.float32)
    np.testing.assert_array_equal(_vision_features(tmp_path, pixels), _vision_features(folder, pixels))
    old, new = load_model(str(folder), dtype="float32"), load_model(str(tmp_path), dtype="float32")
    import jax

    for a, b in zip(jax.tree.leaves(old.state), jax.tree.leaves(new.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlavaForConditionalGeneration"]


def test_partial_configs_take_transformers_defaults(make_llava, tmp_path):
    """llava-hf configs list only what differs from LlamaConfig's and CLIPVisionConfig's defaults: the loader fills
    the rest in as transformers does (here: a text config without rms_norm_eps, a vision config without
    layer_norm_eps)."""
    import shutil

    folder, _ = make_llava("base")
    shutil.copytree(folder, tmp_path / "partial")
    path = tmp_path / "partial" / "config.json"
    config = json.loads(path.read_text())
    del config["text_config"]["rms_norm_eps"], config["vision_config"]["layer_norm_eps"]
    path.write_text(json.dumps(config))
    loaded = load_model(str(tmp_path / "partial"), dtype="float32")
    assert loaded.config.rms_norm_eps == 1e-6 and loaded.vision.config.vision.layer_norm_eps == 1e-5
    assert loaded.vision.tokens_per_image == 16 and loaded.vision.image_token == "<image>"
