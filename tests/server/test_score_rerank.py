"""/v1/score, /score, /v1/rerank, /rerank and /v2/rerank on live servers over a tiny cross-encoder and over
all-MiniLM-L6-v2 (cosine scores), checked against offline Engine.score on the served engine; bad requests are 400s in
OpenAI's error shape, and a generative model's server refuses to score."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.models.test_cross_encoder import save_tiny_cross_encoder
from tests.server.conftest import start_server

CE_MODEL, EMBED_MODEL = "tiny-cross-encoder", "all-MiniLM-L6-v2"
# An encoder runs no paged attention (naming a backend skips building the native kernels); shapes compile when met.
ENCODER_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=256, attention_backend="xla", precompile=False)
QUERY = "what is the capital of france"
DOCUMENTS = ["paris", "Берлин — столица Германии.", "", "the capital of france is paris", "🎉 emoji", "boats"]
LONG = " ".join(f"clause {i} of a document longer than the model's limit" for i in range(30))  # > 128 tokens


@pytest.fixture(scope="module")
def ce_server(tmp_path_factory):
    folder = save_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))
    server = start_server(folder, served_model_names=[CE_MODEL], engine_args=ENCODER_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embed_server():
    server = start_server(EMBED_MODEL, served_model_names=[EMBED_MODEL], engine_args=ENCODER_ARGS)
    yield server
    server.stop()


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=server.headers, timeout=300)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def _offline(server, text_1, text_2) -> list:
    return server.engine.engine.score(text_1, text_2, use_tqdm=False)  # the served Engine, called directly


@pytest.mark.parametrize("route", ["/v1/score", "/score"])
def test_score_matches_offline_score_one_to_n_and_n_to_n(ce_server, route):
    body = _post(ce_server, route, {"model": CE_MODEL, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    offline = _offline(ce_server, QUERY, DOCUMENTS)
    assert body["object"] == "list" and body["model"] == CE_MODEL and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert {d["object"] for d in body["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in body["data"]], [o.outputs.score for o in offline], atol=1e-6)
    tokens = sum(len(o.prompt_token_ids) for o in offline)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    queries = [QUERY, "boats", "", "paris", "x", QUERY]
    pairs = _post(ce_server, route, {"text_1": queries, "text_2": DOCUMENTS}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in pairs],
                               [o.outputs.score for o in _offline(ce_server, queries, DOCUMENTS)], atol=1e-6)


@pytest.mark.parametrize("route", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_offline_score(ce_server, route):
    expected = [o.outputs.score for o in _offline(ce_server, QUERY, DOCUMENTS)]
    body = _post(ce_server, route, {"model": CE_MODEL, "query": QUERY, "documents": DOCUMENTS}).json()
    assert body["model"] == CE_MODEL and body["id"].startswith("rerank-")
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert [r["relevance_score"] for r in results] == sorted([r["relevance_score"] for r in results], reverse=True)
    np.testing.assert_allclose([r["relevance_score"] for r in results], [expected[r["index"]] for r in results],
                               atol=1e-6)
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    assert body["usage"]["total_tokens"] == sum(len(o.prompt_token_ids)
                                                for o in _offline(ce_server, QUERY, DOCUMENTS))
    top = _post(ce_server, route, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                   "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top)


def test_embedding_model_scores_and_reranks_by_cosine_similarity(embed_server):
    offline = [o.outputs.score for o in _offline(embed_server, QUERY, DOCUMENTS)]
    body = _post(embed_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], offline, atol=1e-6)
    assert max(offline) <= 1.0 + 1e-6 and np.ptp(offline) > 0.1
    ranked = _post(embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(offline)[::-1][:3])
    assert _error(_post(embed_server, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}))["param"] == "text_1"


@pytest.mark.parametrize("route, body, param, message", [
    ("/v1/rerank", {"documents": ["a"]}, "query", "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least one text"),
    ("/v2/rerank", {"query": "q", "documents": ["d"] * 1009}, "documents", "at most 1008"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "1:1, 1:N or N:N"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", "at least one text"),
    ("/v1/score", {"text_1": "a", "text_2": [1, 2]}, "text_2", "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ""),
    ("/v1/score", {"text_1": LONG, "text_2": "b"}, "text_2", "maximum context length is 128 tokens"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", ""),
])
def test_bad_requests_are_400s_naming_the_field(ce_server, route, body, param, message):
    error = _error(_post(ce_server, route, body))
    assert error["param"].startswith(param) and message in error["message"], error


def test_truncate_prompt_tokens_lets_a_long_pair_through(ce_server):
    body = _post(ce_server, "/v1/score", {"text_1": LONG, "text_2": "b", "truncate_prompt_tokens": -1}).json()
    assert body["usage"]["prompt_tokens"] == 128
    offline = ce_server.engine.engine.score(LONG, "b", truncate_prompt_tokens=-1, use_tqdm=False)
    assert body["data"][0]["score"] == pytest.approx(offline[0].outputs.score, abs=1e-6)


def test_cross_encoder_refuses_embeddings_and_chat(ce_server):
    error = _error(_post(ce_server, "/v1/embeddings", {"input": "hello"}))
    assert "cross-encoder" in error["message"] and "/v1/score" in error["message"]
    chat = _post(ce_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert "cross-encoder: it cannot generate" in _error(chat)["message"]


def test_routes_are_documented(ce_server):
    paths = httpx.get(ce_server.url + "/openapi.json").json()["paths"]
    for route in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
        assert "400" in paths[route]["post"]["responses"], route


@pytest.mark.parametrize("route, body", [("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}),
                                         ("/v1/rerank", {"query": "a", "documents": ["b"]})])
def test_a_generative_model_refuses_to_score(live_server, route, body):
    error = _error(_post(live_server, route, body))
    assert "generative model" in error["message"] and error["param"] == "model"


@pytest.mark.parametrize("route", ["/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"])
def test_the_routes_need_the_api_key(ce_server, route):
    reply = httpx.post(ce_server.url + route, json={"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]},
                       timeout=60)
    assert _error(reply, 401)["code"] == "invalid_api_key"
