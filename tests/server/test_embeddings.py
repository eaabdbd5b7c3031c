"""/v1/embeddings on a live server over all-MiniLM-L6-v2, checked with the openai client against offline
Engine.embed on the same model; error cases with raw httpx."""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from tests.server.conftest import API_KEY, start_server

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["A man is eating food.", "", "Привет, как дела?", "東京は日本の首都です。", "?!... ;-)",
         "The quick brown fox jumps over the lazy dog " * 3]
LONG = " ".join(f"sentence {i} keeps going past the model's limit of tokens;" for i in range(60))  # > 256 tokens


@pytest.fixture(scope="module")
def embed_server():
    server = start_server(MODEL, served_model_names=[MODEL], engine_args={})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline():
    from jvllm import Engine

    return Engine(model=MODEL, precompile=False)


@pytest.fixture(scope="module")
def expected(offline) -> np.ndarray:
    return np.array([o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)])  # [N, 384]


@pytest.fixture
def client(embed_server):
    import openai

    return openai.OpenAI(base_url=embed_server.v1, api_key=API_KEY, max_retries=0, timeout=300)


def _post(server, body: dict, route: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=server.headers, timeout=300)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_openai_client_float_matches_offline_embed(client, expected, offline):
    result = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in result.data])
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert result.model == MODEL and result.object == "list"
    num_tokens = sum(len(offline.get_tokenizer()(t)["input_ids"]) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == num_tokens


def test_openai_client_base64_matches_float(client, expected):
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    np.testing.assert_allclose(decoded, expected, atol=1e-5)
    default = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the client asks for base64 and decodes it
    np.testing.assert_allclose(default.data[0].embedding, expected[0], atol=1e-5)


def test_normalize_false_returns_the_pooled_vectors_as_offline(client, offline, expected):
    from jvllm import PoolingParams

    picked = [0, 2, 5]
    texts = [TEXTS[i] for i in picked]
    raw = client.embeddings.create(model=MODEL, input=texts, encoding_format="float", extra_body={"normalize": False})
    got = np.array([d.embedding for d in raw.data])
    want = np.stack([o.outputs.data for o in offline.encode(texts, PoolingParams(normalize=False), use_tqdm=False)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    norms = np.linalg.norm(got, axis=1)
    assert np.all(np.abs(norms - 1.0) > 0.1)
    np.testing.assert_allclose(got / norms[:, None], expected[picked], atol=1e-5)


def test_token_id_inputs_equal_their_text(client, offline, expected):
    ids = [offline.get_tokenizer()(t)["input_ids"] for t in TEXTS[:3]]
    single = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, expected[0], atol=1e-5)
    np.testing.assert_allclose(np.array([d.embedding for d in many.data]), expected[:3], atol=1e-5)
    assert many.usage.prompt_tokens == sum(map(len, ids))


def test_concurrent_requests_each_get_their_own_vectors(embed_server, expected):
    async def one(client: httpx.AsyncClient, i: int) -> list[float]:
        response = await client.post(embed_server.v1 + "/embeddings", json={"model": MODEL, "input": TEXTS[i % 6]},
                                     headers=embed_server.headers)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    async def run() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    for i, vector in enumerate(asyncio.run(run())):
        np.testing.assert_allclose(vector, expected[i % 6], atol=1e-5)


def test_too_long_input_is_refused_unless_truncation_is_asked(embed_server, offline):
    error = _error(_post(embed_server, {"model": MODEL, "input": ["short", LONG]}), 400)
    assert "maximum context length is 256 tokens" in error["message"] and "input 1" in error["message"]
    assert error["param"] == "input"
    ok = _post(embed_server, {"model": MODEL, "input": LONG, "truncate_prompt_tokens": -1})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == 256
    want = offline.embed(LONG, truncate_prompt_tokens=-1, use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(ok.json()["data"][0]["embedding"], want, atol=1e-5)


@pytest.mark.parametrize("body, message", [
    ({"input": "hi", "dimensions": 64}, "does not support matryoshka"),
    ({"input": []}, "must not be empty"),
    ({"input": [[]]}, "must not be empty"),
    ({"input": [10 ** 9]}, "token ids must be"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    ({"input": "hi", "normalize": "sometimes"}, "normalize"),
])
def test_bad_embedding_requests_are_400(embed_server, body, message):
    error = _error(_post(embed_server, {"model": MODEL, **body}), 400)
    assert message in error["message"], error


def test_unknown_model_is_404(embed_server):
    _error(_post(embed_server, {"model": "nope", "input": "hi"}), 404)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_generation_routes_on_an_embedding_model_are_400(embed_server, route, body):
    error = _error(_post(embed_server, {"model": MODEL, **body}, route), 400)
    assert "is an embedding model" in error["message"] and "/v1/embeddings" in error["message"]


def test_models_route_lists_the_embedding_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_sagemaker_invocations_embed_as_the_embeddings_route(embed_server):
    body = {"model": MODEL, "input": TEXTS[:3]}
    own, invoked = _post(embed_server, body).json(), _post(embed_server, body, "/invocations").json()
    assert invoked["data"] == own["data"] and invoked["usage"] == own["usage"]
