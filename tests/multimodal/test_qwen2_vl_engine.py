"""Qwen2-VL and Qwen2.5-VL in the engine against transformers (float32): placeholder expansion, multimodal RoPE
positions, prompt logits and greedy generation with one, two and three images of different sizes on every attention
backend (both families); on Qwen2-VL, chunked prefill inside image spans, prefix-cache keys, the encoder cache, chat
content parts, processor bounds, refused inputs and no compile after start."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jvllm import Engine, SamplingParams  # noqa: E402
from jvllm.multimodal.positions import mrope_positions  # noqa: E402
from jvllm.worker.compile_watch import compile_watch  # noqa: E402
from jvllm.worker.step_shapes import StepShape  # noqa: E402
from tests.models.test_llama_parity import _assert_greedy_match  # noqa: E402
from tests.multimodal.helpers import (  # noqa: E402
    check_against_oracle, data_url, random_image, record_encoded, record_split_image_spans, run_random_image_workload,
)
from tests.multimodal.qwen2_vl_helpers import IMAGE_PAD_ID, MAX_TOKENS, PLACEHOLDER, qwen2_vl_hf_processor  # noqa: E402
from tests.prompt_logits import prompt_logits  # noqa: E402

LOGITS_ATOL = 1e-4
P = PLACEHOLDER
PROMPTS = [  # (text, number of images): one, two and three images, and text only, in one batch
    (f"USER: {P}\nWhat is shown here? ASSISTANT:", 1),
    (f"Compare {P} with {P}, then say which is brighter.", 2),
    (f"{P}{P} first two, and the last one: {P}. Describe all three of them in detail.", 3),
    ("A prompt without any image at all, just words.", 0),
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def qwen_images():
    """Images whose processed grids differ: 4x6, 4x4 (scaled up), 6x4, 6x10 and 8x8 patches."""
    sizes = [(56, 84), (28, 28), (90, 60), (300, 500), (112, 112), (70, 140)]
    return [random_image(10 + seed, size) for seed, size in enumerate(sizes)]


def _engine(folder, **overrides) -> Engine:
    args = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512, precompile=False,
                max_num_seqs=8, max_num_batched_tokens=256)
    return Engine(str(folder), **{**args, **overrides})


@pytest.fixture(scope="module")
def engine(tiny_qwen2_vl):
    return _engine(tiny_qwen2_vl[0])


def _prompts(images: list) -> list[tuple[str, list]]:
    taken, result = 0, []
    for text, count in PROMPTS:
        result.append((text, images[taken:taken + count]))
        taken += count
    return result


def _request(text: str, images: list):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def test_placeholders_and_rope_positions_match_transformers(qwen_vl, qwen2_vl_tok, qwen_images):
    folder, model, _ = qwen_vl
    engine = _engine(folder)
    processor = qwen2_vl_hf_processor(folder, qwen2_vl_tok)
    for text, images in _prompts(qwen_images)[:3]:
        inputs = processor(text=text, images=images, return_tensors="pt")
        ids, items = engine.mm_processor.expand(qwen2_vl_tok.encode(text), {"image": images})
        assert ids == inputs["input_ids"][0].tolist()  # each <|image_pad|> became its image's token count
        assert len({item.length for item in items}) == len(items)  # the images' sizes differ
        want, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"])
        np.testing.assert_array_equal(mrope_positions(items, 0, len(ids)), want[:, 0].numpy())
        later = mrope_positions(items, len(ids), 3)  # generated tokens continue after the shifted prompt
        np.testing.assert_array_equal(later, np.arange(len(ids), len(ids) + 3)[None].repeat(3, 0) + int(delta))


@pytest.mark.parametrize("num_images", [1, 2, 3])
def test_prompt_logits_match_transformers(num_images, qwen_vl, qwen2_vl_tok, qwen_images):
    folder, model, _ = qwen_vl
    engine = _engine(folder, attention_backend="xla")
    text, images = _prompts(qwen_images)[num_images - 1]
    inputs = dict(qwen2_vl_hf_processor(folder, qwen2_vl_tok)(text=text, images=images, return_tensors="pt"))
    ids, items = engine.mm_processor.expand(qwen2_vl_tok.encode(text), {"image": images})
    got = prompt_logits(engine.runner, ids, items, engine.encoder_cache)
    with torch.no_grad():
        want = model(**inputs).logits[0].float().numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)


def test_greedy_generation_with_one_two_and_three_images_matches_transformers(qwen_vl, qwen_images):
    folder, _, oracle = qwen_vl
    engine = _engine(folder)
    assert engine.runner.backend.name == "cpu"  # the default on a CPU: the native kernel
    cases = _prompts(qwen_images)
    outputs = engine.generate([_request(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    check_against_oracle(outputs, cases, oracle)
    assert engine.encoder_cache.num_pinned == 0 and engine.pages.num_free_pages == engine.pages.num_usable_pages


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_other_attention_backends_give_transformers_tokens_too(qwen_vl, qwen_images, backend):
    folder, _, oracle = qwen_vl
    engine = _engine(folder, attention_backend=backend)
    assert engine.runner.backend.name == backend
    cases = _prompts(qwen_images)
    outputs = engine.generate([_request(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    check_against_oracle(outputs, cases, oracle)


def test_chunked_prefill_splits_prompts_inside_image_spans(tiny_qwen2_vl, qwen2_vl_oracle, qwen_images):
    engine = _engine(tiny_qwen2_vl[0], max_num_seqs=4, max_num_batched_tokens=16)
    spans_split = record_split_image_spans(engine)
    cases = _prompts(qwen_images)[:3]
    outputs = engine.generate([_request(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    assert spans_split, "no chunk ended inside an image's placeholder span"
    check_against_oracle(outputs, cases, qwen2_vl_oracle)


def test_prefix_cache_keys_include_the_images(tiny_qwen2_vl, qwen2_vl_oracle, qwen_images):
    """Same text, different image: only the pages before the image are shared; same image: all full pages (their
    positions, shifted by the image's grid, are the same too)."""
    engine = _engine(tiny_qwen2_vl[0])
    text = ("Here is a long description that fills more than two pages of sixteen tokens before the picture "
            f"arrives, so that those pages can be shared between requests that send the same words: {P} and now "
            "tell me about it, in as many words as you like, with every detail you see.")
    offset = engine.tokenizer.encode(text).index(IMAGE_PAD_ID)
    assert offset >= 32

    def run(image):
        out = engine.generate(_request(text, [image]), GREEDY, use_tqdm=False)[0]
        check_against_oracle([out], [(text, [image])], qwen2_vl_oracle)
        return out

    first = run(qwen_images[0])
    assert first.num_cached_tokens == 0
    other = run(qwen_images[2])  # same text, another image (of another grid: later positions differ too)
    assert other.num_cached_tokens == offset // 16 * 16
    again = run(qwen_images[0])
    image_end = offset + engine.mm_processor.process_image(qwen_images[0]).num_tokens
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 >= image_end
    assert again.outputs[0].token_ids == first.outputs[0].token_ids != other.outputs[0].token_ids


def test_a_repeated_image_comes_from_the_encoder_cache(tiny_qwen2_vl, qwen2_vl_oracle, qwen_images):
    engine = _engine(tiny_qwen2_vl[0], enable_prefix_caching=False)
    encoded = record_encoded(engine)
    cache = engine.encoder_cache
    once = f"{P} once"
    first = engine.generate(_request(once, [qwen_images[3]]), GREEDY, use_tqdm=False)[0]
    assert len(encoded) == 1 and (cache.queries, cache.hits) == (1, 0)
    text = f"The same picture twice: {P} and {P}, what differs?"
    twice = engine.generate(_request(text, [qwen_images[3]] * 2), GREEDY, use_tqdm=False)[0]
    assert len(encoded) == 1 and cache.hits == 1  # nothing encoded again
    check_against_oracle([first, twice], [(once, [qwen_images[3]]), (text, [qwen_images[3]] * 2)], qwen2_vl_oracle)


def test_chat_with_image_content_parts(engine, qwen2_vl_oracle, qwen_images):
    """The chat template sees one vision-start, image-pad, vision-end placeholder per image, then the text."""
    parts = [{"type": "text", "text": "What is in these pictures?"},
             {"type": "image_url", "image_url": {"url": data_url(qwen_images[4])}},
             {"type": "image_pil", "image_pil": qwen_images[1]}]
    out = engine.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{P}\n{P}\nWhat is in these pictures?"}], tokenize=False,
        add_generation_prompt=True)
    check_against_oracle([out], [(text, [qwen_images[4], qwen_images[1]])], qwen2_vl_oracle)


def test_step_shapes_include_the_encoder_and_nothing_compiles_after_start(tiny_qwen2_vl, qwen_images):
    engine = _engine(tiny_qwen2_vl[0], precompile=True, max_num_seqs=4, max_num_batched_tokens=64,
                     kv_cache_memory_bytes=16 * 16 * 512, encoder_cache_tokens=48)
    assert [s for s in engine.step_shapes() if s.kind == "encoder"] == [StepShape("encoder", 16, 1)]
    watch = compile_watch()
    before = watch.total
    run_random_image_workload(engine, qwen_images, P)
    assert watch.total == before, f"{watch.total - before} executables compiled after start-up"
    assert engine.scheduler.num_preemptions > 0  # the KV pool was tight
    engine.pages.check_integrity()
    engine.encoder_cache.check_integrity()
    assert engine.encoder_cache.num_pinned == 0 and engine.pages.num_free_pages == engine.pages.num_usable_pages


def test_refused_qwen2_vl_inputs_name_the_reason_and_the_engine_keeps_serving(engine, qwen_images):
    from jvllm.multimodal.inputs import ProcessedImage

    quick = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    image = engine.mm_processor.process_image(qwen_images[0])  # 6 tokens
    start = engine.tokenizer.encode("look: <|vision_start|>")
    with pytest.raises(ValueError, match="a run of 5 image tokens"):  # an expanded run must hold exactly 6
        engine.generate({"prompt_token_ids": start + [IMAGE_PAD_ID] * 5, "multi_modal_data": {"image": image}},
                        quick, use_tqdm=False)
    wrong_shape = ProcessedImage(image.pixel_values[:-4], image.hash, image.num_tokens, image.grid)
    too_big = ProcessedImage(np.zeros((17 * 4, 1176), np.float32), 1, 17, (1, 17))
    for bad, reason in [(wrong_shape, "processed pixel values of shape"), (too_big, "at most 16")]:
        with pytest.raises(ValueError, match=reason):
            engine.generate(_request(f"{P} x", [bad]), quick, use_tqdm=False)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) \(<\|vision_start\|><\|image_pad\|>"):
        engine.generate(_request(f"{P} and {P}", [qwen_images[0]]), quick, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    expanded = start + [IMAGE_PAD_ID] * 6  # an already expanded run is taken as it is
    out = engine.generate({"prompt_token_ids": expanded, "multi_modal_data": {"image": image}}, quick, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].prompt_token_ids == expanded


def test_mm_processor_kwargs_bound_the_image_size(tiny_qwen2_vl, qwen2_vl_tok, qwen_images):
    """max_pixels as in vLLM: fewer tokens per image, smaller encoder buckets, still transformers' tokens (its
    processor called with the same bounds)."""
    from tests.multimodal.helpers import hf_greedy

    folder, model = tiny_qwen2_vl
    bounds = {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 6}
    engine = _engine(folder, mm_processor_kwargs=bounds)
    assert engine.model.vision.max_image_tokens == 6
    assert [s for s in engine.step_shapes() if s.kind == "encoder"] == [StepShape("encoder", 6, 1)]
    text, images = _prompts(qwen_images)[2]
    processor = qwen2_vl_hf_processor(folder, qwen2_vl_tok)
    size = {"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]}
    inputs = dict(processor(text=text, images=images, images_kwargs={"size": size}, return_tensors="pt"))
    want, logits = hf_greedy(model, inputs, MAX_TOKENS)
    out = engine.generate(_request(text, images), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert all(item.length <= 6 for item in engine.mm_processor.expand(out.prompt_token_ids, {"image": images})[1])
    _assert_greedy_match(out.outputs[0].token_ids, want, logits, "three images within max_pixels")
    for kwargs, reason in [({"max_side": 3}, "unsupported key 'max_side'"), ({"max_pixels": 100}, "at least 784"),
                           ({"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 4}, "exceeds max_pixels")]:
        with pytest.raises(ValueError, match=reason):
            _engine(folder, mm_processor_kwargs=kwargs)


def test_llava_takes_no_mm_processor_kwargs(tiny_llava):
    with pytest.raises(ValueError, match="unsupported key 'max_pixels' for LlavaForConditionalGeneration"):
        _engine(tiny_llava[0], mm_processor_kwargs={"max_pixels": 100_000})


def test_a_chat_template_kept_beside_the_processor_is_used(tiny_qwen2_vl, tmp_path, qwen_images):
    """Checkpoints whose tokenizer config has no chat template but whose folder has chat_template.json (the
    processor's, as hub vision-language repositories keep it) chat with that template."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen2_vl[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for path in folder.glob("chat_template.jinja"):
        path.unlink()
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    engine = _engine(folder)
    assert engine.tokenizer.chat_template == template
    parts = [{"type": "image_pil", "image_pil": qwen_images[1]}, {"type": "text", "text": "Say what it is."}]
    out = engine.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt.startswith(f"<user>{P}\nSay what it is.\n<assistant>")
