"""/v1/chat/completions with image content parts: the openai client sends a base64 image and gets what the offline
engine generates for the same conversation; refused images are 400s naming the reason, and the server keeps serving."""
from __future__ import annotations

import base64

import pytest

openai = pytest.importorskip("openai")

from jvllm import Engine, SamplingParams  # noqa: E402
from tests.multimodal.helpers import data_url  # noqa: E402
from tests.server.conftest import API_KEY, start_server  # noqa: E402

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512, precompile=False,
                   limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("served-media")


@pytest.fixture(scope="module")
def server(tiny_llava, media_dir):
    live = start_server(tiny_llava[0], engine_args={**ENGINE_ARGS, "allowed_local_media_path": str(media_dir)})
    yield live
    live.stop()


@pytest.fixture(scope="module")
def text_server(tiny_text_llama):
    live = start_server(tiny_text_llama, engine_args=dict(ENGINE_ARGS, limit_mm_per_prompt=None))
    yield live
    live.stop()


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key=API_KEY, max_retries=0, timeout=300)


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "What do you see in this picture?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


def test_openai_client_sends_a_base64_image(server, tiny_llava, images):
    url = data_url(images[0])
    reply = _client(server).chat.completions.create(model="tiny-llama", messages=_messages(url), max_tokens=16,
                                                    temperature=0.0)
    offline = Engine(str(tiny_llava[0]), **{**ENGINE_ARGS, "precompile": False})
    want = offline.chat(_messages(url), SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    assert reply.choices[0].message.content == want.outputs[0].text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)  # the image's 16 tokens counted
    assert reply.usage.completion_tokens == len(want.outputs[0].token_ids)
    chunks = _client(server).chat.completions.create(model="tiny-llama", messages=_messages(url), max_tokens=16,
                                                     temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text


def test_a_local_file_under_the_allowed_path(server, media_dir, images):
    images[1].save(media_dir / "cat.png")
    reply = _client(server).chat.completions.create(model="tiny-llama", max_tokens=4, temperature=0.0,
                                                    messages=_messages(f"file://{media_dir}/cat.png"))
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("urls, reason", [
    (["file:///etc/hostname"], "outside the allowed local media path"),
    (["data:image/png;base64," + base64.b64encode(b"garbage").decode()], "could not decode the image"),
    (["https://"], "has no host"),
    (["http://127.0.0.1:9/internal-admin"], "non-public address 127.0.0.1"),
    (["http://169.254.169.254/latest/meta-data/"], "non-public address 169.254.169.254"),
    (["gopher://x/y.png"], "unsupported image URL scheme"),
    (["data:image/png;base64,AAAA"] * 3, "limit_mm_per_prompt allows 2"),
])
def test_refused_images_are_400s_naming_the_reason(server, images, urls, reason):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny-llama", messages=_messages(*urls), max_tokens=4)
    assert error.value.status_code == 400 and reason in str(error.value)
    ok = client.chat.completions.create(model="tiny-llama", messages=_messages(data_url(images[2])), max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_an_image_for_a_text_only_model_is_a_400(text_server, images):
    client = _client(text_server)
    with pytest.raises(openai.BadRequestError, match="text-only"):
        client.chat.completions.create(model="tiny-llama", messages=_messages(data_url(images[0])), max_tokens=4)
    ok = client.chat.completions.create(model="tiny-llama", max_tokens=4,
                                        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_qwen2_vl_over_the_openai_client(tiny_qwen2_vl):
    """Two base64 images of different sizes (so different token counts) through the server match the offline
    engine, and usage counts each image's own tokens."""
    from tests.multimodal.helpers import random_image

    urls = [data_url(random_image(20, (56, 84))), data_url(random_image(21, (300, 500)))]
    live = start_server(tiny_qwen2_vl[0], engine_args=ENGINE_ARGS, served_model_names=["tiny-qwen2-vl"])
    try:
        reply = _client(live).chat.completions.create(model="tiny-qwen2-vl", messages=_messages(*urls),
                                                      max_tokens=16, temperature=0.0)
        with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt allows 2"):
            _client(live).chat.completions.create(model="tiny-qwen2-vl", messages=_messages(*urls, urls[0]))
    finally:
        live.stop()
    offline = Engine(str(tiny_qwen2_vl[0]), **ENGINE_ARGS)
    want = offline.chat(_messages(*urls), SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    assert reply.choices[0].message.content == want.outputs[0].text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    images = [item.length for item in offline.mm_processor.expand(want.prompt_token_ids,
                                                                  {"image": [random_image(20, (56, 84)),
                                                                             random_image(21, (300, 500))]})[1]]
    assert images == [6, 15]  # 4x6 and 6x10 patches, merged 2x2
