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


def greedy_oracle(model, processor, max_new_tokens: int = 32):
    """(text, images) -> transformers' greedy ids and logits for it (through `processor`), memoized."""
    cache: dict = {}

    def run(text: str, images: list) -> tuple[list[int], np.ndarray]:
        key = (text, tuple(id(image) for image in images))
        if key not in cache:
            cache[key] = hf_greedy(model, hf_inputs(processor, text, images), max_new_tokens)
        return cache[key]

    return run


def hf_logits(model, inputs: dict) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(**inputs).logits[0].float().numpy()


LOGPROB_ATOL = 1e-4  # jvllm's logprob of each greedy token against transformers' (float32)


def check_against_oracle(outputs, cases, oracle) -> None:
    """Each output's greedy tokens against transformers' for its (text, images) case (identical, or diverging only
    at a near tie), and the logprob of every token before any divergence within LOGPROB_ATOL."""
    import torch

    from tests.models.test_llama_parity import _assert_greedy_match

    for output, (text, images) in zip(outputs, cases):
        want, logits = oracle(text, images)
        got = output.outputs[0]
        _assert_greedy_match(got.token_ids, want, logits, f"{text!r} with {len(images)} image(s)")
        ref = torch.log_softmax(torch.tensor(logits), -1).numpy()
        for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            if got.token_ids[:step + 1] == want[:step + 1]:
                assert abs(entry[token].logprob - ref[step, token]) < LOGPROB_ATOL


def record_split_image_spans(engine) -> list:
    """Wrap the engine's scheduler: -> a list that collects every image item a scheduled chunk ends inside of."""
    split: list = []
    schedule = engine.scheduler.schedule

    def schedule_and_note_splits():
        chunks = schedule()
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            split.extend(item for item in chunk.request.mm_items if item.offset < end < item.end)
        return chunks

    engine.scheduler.schedule = schedule_and_note_splits
    return split


def record_encoded(engine) -> list[int]:
    """Wrap the engine's encoder: -> a list that collects the hash of every image it encodes."""
    encoded: list[int] = []
    calls = engine.runner.encoder.calls
    engine.runner.encoder.calls = lambda items: (encoded.extend(i.key for i in items), calls(items))[1]
    return encoded


def run_random_image_workload(engine, images: list, placeholder: str, num_requests: int = 24) -> None:
    """Requests arriving a few per step until `num_requests` were added and all finished: 1 to 100 random words
    with 0 to 3 images each at random places, greedy or sampled, n of 1 or 2."""
    import random

    from jvllm import SamplingParams

    rng = random.Random(0)
    words = "the a river mill children sea boats tide stone light door".split()
    pending = num_requests
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                pending -= 1
                count = rng.randint(0, 3)
                parts = [rng.choice(words) for _ in range(rng.randint(1, 100))]
                for _ in range(count):
                    parts.insert(rng.randint(0, len(parts)), placeholder)
                chosen = [images[rng.randint(0, len(images) - 1)] for _ in range(count)]
                params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]),
                                        n=rng.choice([1, 1, 2]), seed=rng.randint(0, 99))
                engine.add_request(f"r{pending}", {"prompt": " ".join(parts), "multi_modal_data": {"image": chosen}},
                                   params)
        engine.step()
