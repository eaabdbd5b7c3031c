"""Every refused multimodal input is a ValueError naming the reason, nothing is left queued, and the engine keeps
serving: images for a text-only model, corrupt or unsupported images, more images than limit_mm_per_prompt,
placeholders that do not match the images, URLs outside the allowed local path, and http fetches that fail."""
from __future__ import annotations

import base64
import http.server
import threading
import time

import pytest

from jvllm import Engine, SamplingParams
from jvllm.multimodal.inputs import parse_limits
from jvllm.multimodal.media import MediaLoader
from tests.multimodal.helpers import data_url

QUICK = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(folder, **overrides) -> Engine:
    return Engine(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=256, precompile=False,
                  **overrides)


@pytest.fixture(scope="module")
def engine(tiny_llava, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    return _engine(tiny_llava[0], limit_mm_per_prompt={"image": 2}, allowed_local_media_path=str(media),
                   allowed_media_domains=["127.0.0.1"], max_image_pixels=2048 * 2048)


def _still_serving(engine: Engine, image) -> None:
    assert not engine.has_unfinished_requests() and engine.pages.num_free_pages == engine.pages.num_usable_pages
    out = engine.generate({"prompt": "<image> fine", "multi_modal_data": {"image": image}}, QUICK, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}]


def test_images_for_a_text_only_model(tiny_text_llama, images):
    engine = _engine(tiny_text_llama)
    with pytest.raises(ValueError, match="text-only"):
        engine.generate({"prompt": "<image> hi", "multi_modal_data": {"image": images[0]}}, QUICK, use_tqdm=False)
    with pytest.raises(ValueError, match="text-only"):
        engine.chat(_user({"type": "image_url", "image_url": {"url": data_url(images[0])}}), QUICK, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert len(engine.generate("still fine", QUICK, use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("url, reason", [
    ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "could not decode the image"),
    ("data:image/png;base64,@@@not-base64@@@", "base64 payload is invalid"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "is not an image"),
    ("ftp://example.com/cat.png", "unsupported image URL scheme"),
    ("file:///etc/hostname", "outside the allowed local media path"),
])
def test_corrupt_unsupported_and_refused_image_urls(engine, images, url, reason):
    with pytest.raises(ValueError, match=reason):
        engine.chat(_user({"type": "image_url", "image_url": {"url": url}}), QUICK, use_tqdm=False)
    _still_serving(engine, images[0])


def test_local_files_only_under_the_allowed_path(engine, images, tmp_path):
    root = engine.media.allowed_root
    images[1].save(root / "ok.png")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    outside = tmp_path / "secret.png"
    images[1].save(outside)
    (root / "link.png").symlink_to(outside)  # a symlink inside that points outside
    ok = engine.chat(_user({"type": "image_url", "image_url": {"url": f"file://{root}/ok.png"}}), QUICK,
                     use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4
    for name, reason in [(f"{root}/../{tmp_path.name}/secret.png", "outside the allowed"),
                         (f"{root}/link.png", "outside the allowed"), (f"{root}/missing.png", "no image file"),
                         (f"{root}/broken.png", "could not decode")]:
        with pytest.raises(ValueError, match=reason):
            engine.chat(_user({"type": "image_url", "image_url": {"url": f"file://{name}"}}), QUICK, use_tqdm=False)
    without = MediaLoader(None)
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        without.load_image(f"file://{root}/ok.png")
    _still_serving(engine, images[0])


def test_inputs_that_are_not_images(engine, images):
    for bad, reason in [("a string", "must be a PIL.Image"), (3.5, "must be a PIL.Image")]:
        with pytest.raises(ValueError, match=reason):
            engine.generate({"prompt": "<image>", "multi_modal_data": {"image": bad}}, QUICK, use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported modality 'audio'"):
        engine.generate({"prompt": "hi", "multi_modal_data": {"audio": b"x"}}, QUICK, use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported content part type 'input_audio'"):
        engine.chat(_user({"type": "input_audio", "input_audio": {}}), QUICK, use_tqdm=False)
    _still_serving(engine, images[0])


def test_more_images_than_the_limit_and_mismatched_placeholders(engine, images):
    with pytest.raises(ValueError, match="3 images but limit_mm_per_prompt allows 2"):
        engine.generate({"prompt": "<image>" * 3, "multi_modal_data": {"image": images[:3]}}, QUICK, use_tqdm=False)
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) \(<image>\) but 2 image\(s\)"):
        engine.generate({"prompt": "<image> x", "multi_modal_data": {"image": images[:2]}}, QUICK, use_tqdm=False)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) \(<image>\) but 0 image\(s\)"):
        engine.generate("<image> and <image> without images", QUICK, use_tqdm=False)
    with pytest.raises(ValueError, match="a run of 17 image tokens"):
        engine.generate({"prompt_token_ids": [5] + [49152] * 17, "multi_modal_data": {"image": images[:1]}}, QUICK,
                        use_tqdm=False)
    # a batch with one bad prompt queues nothing
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        engine.generate([{"prompt": "<image>", "multi_modal_data": {"image": images[0]}},
                         {"prompt": "<image><image><image>", "multi_modal_data": {"image": images[:3]}}], QUICK,
                        use_tqdm=False)
    for limits, reason in [({"video": 1}, "unsupported modality 'video'"), ({"image": -1}, "integer >= 0")]:
        with pytest.raises(ValueError, match=reason):
            parse_limits(limits)
    _still_serving(engine, images[0])


def test_already_expanded_placeholders_are_taken_as_they_are(engine, images):
    ids = engine.tokenizer.encode("<image> look")
    expanded, items = engine.mm_processor.expand(ids, {"image": images[0]})
    again, items_again = engine.mm_processor.expand(expanded, {"image": images[0]})
    assert again == expanded and [i.offset for i in items_again] == [i.offset for i in items]
    first = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images[0]}}, QUICK, use_tqdm=False)
    second = engine.generate({"prompt_token_ids": expanded, "multi_modal_data": {"image": images[0]}}, QUICK,
                             use_tqdm=False)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids


class _Handler(http.server.BaseHTTPRequestHandler):
    png = b""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/slow.png":
            time.sleep(2)
        if self.path in ("/ok.png", "/slow.png", "/big.png"):
            body = self.png if self.path != "/big.png" else self.png * 200
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server(images):
    import io

    buffer = io.BytesIO()
    images[3].save(buffer, format="PNG")
    _Handler.png = buffer.getvalue()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_images_with_a_timeout_and_a_size_limit(image_server, images):
    loader = MediaLoader(None, allowed_media_domains=["127.0.0.1"], timeout_s=0.5, max_bytes=len(_Handler.png) * 10)
    assert loader.load_image(f"{image_server}/ok.png").size == images[3].size
    for path, reason in [("/missing.png", "HTTP 404"), ("/big.png", "larger than"), ("/slow.png", "timed out")]:
        with pytest.raises(ValueError, match=reason):
            loader.load_image(image_server + path)


def test_the_engine_passes_its_media_settings_to_the_loader(engine, image_server, images):
    """Engine(allowed_media_domains=..., max_image_pixels=...) reach the loader its chat() uses."""
    assert engine.media.url_policy.allowed_domains == frozenset({"127.0.0.1"})
    assert engine.media.max_image_pixels == 2048 * 2048
    assert engine.media.load_image(f"{image_server}/ok.png").size == images[3].size
