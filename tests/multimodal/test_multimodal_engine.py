"""Engine.generate / Engine.chat with images on the tiny LLaVA against transformers' greedy generation (float32),
and the engine's multimodal machinery: chunked prefill inside image spans, prefix-cache keys that include the images,
the encoder cache (hits, eviction under pressure) and no compile after start-up."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from jvllm import Engine, SamplingParams  # noqa: E402
from jvllm.worker.compile_watch import compile_watch  # noqa: E402
from jvllm.worker.step_shapes import StepShape  # noqa: E402
from tests.multimodal.helpers import (  # noqa: E402
    check_against_oracle, data_url, greedy_oracle, hf_processor, record_encoded, record_split_image_spans,
    run_random_image_workload,
)

MAX_TOKENS = 32
PROMPTS = [  # (text, number of images): one, two and three images, and text only, in one batch
    ("USER: <image>\nWhat is shown here? ASSISTANT:", 1),
    ("Compare <image> with <image>, then say which is brighter.", 2),
    ("<image><image> first two, and the last one: <image>. Describe all three of them in detail.", 3),
    ("A prompt without any image at all, just words.", 0),
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def _engine(folder, **overrides) -> Engine:
    args = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512, precompile=False)
    return Engine(str(folder), **{**args, **overrides})


@pytest.fixture(scope="module")
def engine(tiny_llava):
    return _engine(tiny_llava[0], max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def oracle(tiny_llava, llava_tokenizer):
    """(text, images) -> transformers' greedy ids and logits for it."""
    folder, model = tiny_llava
    return greedy_oracle(model, hf_processor(folder, llava_tokenizer, model), MAX_TOKENS)


def _prompts(images: list) -> list[tuple[str, list]]:
    taken, result = 0, []
    for text, count in PROMPTS:
        result.append((text, images[taken:taken + count]))
        taken += count
    return result


def test_greedy_generation_with_one_two_and_three_images_matches_transformers(engine, oracle, images):
    assert engine.runner.backend.name == "cpu"  # the default on a CPU: the native kernel
    cases = _prompts(images)
    outputs = engine.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                               for text, imgs in cases], GREEDY, use_tqdm=False)
    check_against_oracle(outputs, cases, oracle)
    expected_lengths = [len(engine.tokenizer.encode(text)) + 15 * n for text, n in PROMPTS]
    assert [len(o.prompt_token_ids) for o in outputs] == expected_lengths  # each <image> became 16 tokens
    assert engine.encoder_cache.num_pinned == 0 and engine.pages.num_free_pages == engine.pages.num_usable_pages


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_other_attention_backends_give_transformers_tokens_too(tiny_llava, oracle, images, backend):
    """The engine above runs the default (native cpu) kernel; the plain-jnp backend and the Pallas kernels (interpret
    mode on CPU) take the same image prompts, one to three images, mixed with a text-only one."""
    engine = _engine(tiny_llava[0], max_num_seqs=8, max_num_batched_tokens=256, attention_backend=backend)
    assert engine.runner.backend.name == backend
    cases = _prompts(images)
    outputs = engine.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                               for text, imgs in cases], GREEDY, use_tqdm=False)
    check_against_oracle(outputs, cases, oracle)


def test_chunked_prefill_splits_prompts_inside_image_spans(tiny_llava, oracle, images):
    engine = _engine(tiny_llava[0], max_num_seqs=4, max_num_batched_tokens=16)
    spans_split = record_split_image_spans(engine)
    cases = _prompts(images)[:3]
    outputs = engine.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases], GREEDY,
                              use_tqdm=False)
    assert spans_split, "no chunk ended inside an image's placeholder span"
    check_against_oracle(outputs, cases, oracle)


def test_prefix_cache_keys_include_the_images(tiny_llava, oracle, images):
    """Same text, different image: only the pages before the image are shared; same image: all full pages."""
    engine = _engine(tiny_llava[0])
    text = ("Here is a long description that fills more than two pages of sixteen tokens before the picture "
            "arrives, so that those pages can be shared between requests that send the same words with other "
            "pictures: <image> and now tell me about it, in as many words as you like, with every detail you see.")
    offset = engine.tokenizer.encode(text).index(49152)
    assert offset >= 32

    def run(image):
        out = engine.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)[0]
        check_against_oracle([out], [(text, [image])], oracle)
        return out

    first = run(images[0])
    assert first.num_cached_tokens == 0
    other = run(images[1])  # same text, another image
    assert other.num_cached_tokens == offset // 16 * 16
    again = run(images[0])  # the first image again
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 >= offset + 16  # image included
    assert again.outputs[0].token_ids == first.outputs[0].token_ids != other.outputs[0].token_ids


def test_a_repeated_image_comes_from_the_encoder_cache(tiny_llava, oracle, images):
    engine = _engine(tiny_llava[0], enable_prefix_caching=False)
    encoded = record_encoded(engine)
    cache = engine.encoder_cache
    first = engine.generate({"prompt": "<image> once", "multi_modal_data": {"image": images[3]}}, GREEDY,
                            use_tqdm=False)[0]
    assert len(encoded) == 1 and (cache.queries, cache.hits) == (1, 0)
    text = "The same picture twice: <image> and <image>, what differs?"
    twice = engine.generate({"prompt": text, "multi_modal_data": {"image": [images[3], images[3]]}}, GREEDY,
                            use_tqdm=False)[0]
    assert len(encoded) == 1 and cache.hits == 1  # nothing encoded again
    check_against_oracle([first, twice], [("<image> once", [images[3]]), (text, [images[3], images[3]])], oracle)


def test_encoder_cache_pressure_evicts_least_recently_used_images(tiny_llava, oracle, images):
    """Room for 3 images only (48 rows plus the reserved block) while 4 prompts with 6 images run at once."""
    engine = _engine(tiny_llava[0], encoder_cache_tokens=48, enable_prefix_caching=False)
    cache = engine.encoder_cache
    assert cache.capacity == 48
    encoded = record_encoded(engine)
    cases = _prompts(images)
    outputs = engine.generate([{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases],
                              GREEDY, use_tqdm=False)
    check_against_oracle(outputs, cases, oracle)
    assert len(set(encoded)) == 6 and len(encoded) == 6  # each image encoded once, some evicted since
    assert sum(key in cache for key in encoded) <= 3
    cache.check_integrity()
    assert cache.num_pinned == 0


def test_chat_with_image_content_parts(engine, oracle, images, tmp_path):
    """image_url (data: and file: URLs) and image_pil parts; the prompt is the template over '<image>\\n' + text,
    as vLLM writes string-content messages."""
    path = tmp_path / "picture.png"
    images[2].save(path)
    engine.media = type(engine.media)(str(tmp_path))  # allowed_local_media_path for this test
    parts = [{"type": "text", "text": "What is in these pictures?"},
             {"type": "image_url", "image_url": {"url": data_url(images[0])}},
             {"type": "image_pil", "image_pil": images[1]},
             {"type": "image_url", "image_url": {"url": f"file://{path}"}}]
    out = engine.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>\n<image>\n<image>\nWhat is in these pictures?"}], tokenize=False,
        add_generation_prompt=True)
    # PNG keeps the pixels: the decoded images are the originals
    check_against_oracle([out], [(text, images[:3])], oracle)


def test_step_shapes_include_the_encoder_and_nothing_compiles_after_start(tiny_llava, images):
    engine = _engine(tiny_llava[0], precompile=True, max_num_seqs=4, max_num_batched_tokens=64,
                     kv_cache_memory_bytes=16 * 16 * 512, encoder_cache_tokens=64)
    assert engine.step_shapes()[-1] == StepShape("encoder", 16, 1)
    assert [s.kind for s in engine.step_shapes()].count("encoder") == 1
    watch = compile_watch()
    before = watch.total
    run_random_image_workload(engine, images, "<image>")
    assert watch.total == before, f"{watch.total - before} executables compiled after start-up"
    assert engine.scheduler.num_preemptions > 0  # the KV pool was tight
    engine.pages.check_integrity()
    engine.encoder_cache.check_integrity()
    assert engine.encoder_cache.num_pinned == 0 and engine.pages.num_free_pages == engine.pages.num_usable_pages
