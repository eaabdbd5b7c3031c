"""Test helpers: the tiny LLaVA's configs, transformers' processing and greedy generation as the oracle."""
from __future__ import annotations

import base64
import copy
import io
import pathlib

import numpy as np

IMAGE_TOKEN_ID = 49152
TOKENS_PER_IMAGE = 16  # (28 / 7) ** 2 patches, the class token dropped ("default")
TEXT = dict(vocab_size=49153, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=28,
              patch_size=7)


def build_llava(folder: pathlib.Path, tokenizer, *, vision: dict | None = None, **llava: object):
    """Save a tiny random LlavaForConditionalGeneration (weights redrawn large, see tests/hf_weights.py), the
    tokenizer and a CLIP image processor config into `folder`; -> the transformers model (float32, eval)."""
    import torch
    import transformers

    from tests.hf_weights import redraw_weights

    config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**{**VISION, **(vision or {})}),
                                      text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMAGE_TOKEN_ID,
                                      **llava)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    redraw_weights(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    size = config.vision_config.image_size
    transformers.CLIPImageProcessorPil(size={"shortest_edge": size},
                                       crop_size={"height": size, "width": size}).save_pretrained(folder)
    return model


def random_image(seed: int, size: tuple[int, int]):
    """A random RGB PIL image of (height, width)."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def hf_processor(folder: pathlib.Path, tokenizer, model):
    """transformers' LlavaProcessor over the folder's image processor (PIL backend) and the tokenizer."""
    import transformers

    image_processor = transformers.AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    return transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                       patch_size=model.config.vision_config.patch_size,
                                       vision_feature_select_strategy=model.config.vision_feature_select_strategy,
                                       num_additional_image_tokens=1)


def hf_inputs(processor, text: str, images: list) -> dict:
    """transformers' expanded input ids and pixel values (torch tensors)."""
    return dict(processor(text=text, images=images or None, return_tensors="pt"))


def hf_greedy(model, inputs: dict, max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers greedy generation, no EOS stopping -> (new ids, raw logits [N, V])."""
    import torch

    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens, config.min_new_tokens = False, max_new_tokens, None
    config.eos_token_id, config.pad_token_id = None, 0
    config.output_logits, config.return_dict_in_generate = True, True
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=config)
    prompt_len = inputs["input_ids"].shape[1]
    new = out.sequences[0, prompt_len:].tolist()
    assert len(new) == max_new_tokens
    return new, torch.stack(out.logits)[:, 0].float().numpy()


def hf_logits(model, inputs: dict) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(**inputs).logits[0].float().numpy()
