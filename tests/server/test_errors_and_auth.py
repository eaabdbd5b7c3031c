"""Raw HTTP: OpenAI error bodies and status codes, the API key, and the public routes."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in reply.text
    return body["error"]


@pytest.mark.parametrize("route", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                                   "/tokenize", "/detokenize"])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {API_KEY}", API_KEY])
def test_missing_or_wrong_key_is_401(live_server, route, auth):
    headers = {"Authorization": auth} if auth else {}
    method = httpx.get if route == "/v1/models" else httpx.post
    kwargs = {} if route == "/v1/models" else {"json": {"prompt": "hi"}}
    error = _error(method(live_server.url + route, headers=headers, **kwargs), 401)
    assert error["code"] == "invalid_api_key"


def test_public_routes_need_no_key(live_server):
    assert httpx.get(f"{live_server.url}/health").status_code == 200
    version = httpx.get(f"{live_server.url}/version")
    assert version.status_code == 200 and version.json()["version"]
    metrics = httpx.get(f"{live_server.url}/metrics")
    assert metrics.status_code == 200
    assert f'jvllm:num_requests_running{{model_name="{MODEL}"}}' in metrics.text
    for name in ("num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"jvllm:{name}" in metrics.text, name
    docs = httpx.get(f"{live_server.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schema = httpx.get(f"{live_server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(schema["paths"])


def test_metrics_count_tokens_and_finished_requests(live_server):
    def sample(name: str) -> float:
        text = httpx.get(f"{live_server.url}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    generated = sample("jvllm:generation_tokens_total")
    finished = sample('jvllm:request_success_total{finished_reason="length"')
    reply = httpx.post(f"{live_server.v1}/completions", headers=live_server.headers, timeout=120,
                       json={"prompt": "count me", "max_tokens": 7, "ignore_eos": True})
    assert reply.status_code == 200
    assert sample("jvllm:generation_tokens_total") == generated + 7
    assert sample('jvllm:request_success_total{finished_reason="length"') == finished + 1


def test_metrics_report_prefix_cache_hits_for_a_repeated_prompt(live_server):
    def sample(name: str) -> float:
        text = httpx.get(f"{live_server.url}/metrics").text
        return float(next(x for x in text.splitlines() if x.startswith(name)).rsplit(" ", 1)[1])

    prompt = " ".join(f"word{i}" for i in range(40))  # several full KV pages
    hits = sample("jvllm:prefix_cache_hits_total")
    for _ in range(2):
        assert _post(live_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).status_code == 200
    assert sample("jvllm:prefix_cache_hits_total") >= hits + 16
    assert sample("jvllm:prefix_cache_queries_total") > sample("jvllm:prefix_cache_hits_total")


def _post(server, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=server.headers, timeout=600, **kwargs,
                      **({"json": body} if body is not None else {}))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": {"nested": 1}}, "prompt"),
])
def test_invalid_fields_are_400_not_422(live_server, body, param):
    error = _error(_post(live_server, "/v1/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param)


def test_malformed_json_is_400(live_server):
    reply = httpx.post(f"{live_server.v1}/chat/completions", content=b"{not json",
                       headers={**live_server.headers, "Content-Type": "application/json"})
    error = _error(reply, 400)
    assert error["message"].startswith("the request body is not valid JSON: ") and "(at character 1)" in error["message"]
    assert error["param"] is None


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "top_p": 2.0},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "logprobs": 50},
    {"prompt": "hi", "best_of": 3},
    {"prompt": "hi", "suffix": "tail"},
    {"prompt": "hi", "min_tokens": 9, "max_tokens": 3},
    {"prompt": "hi", "stream_options": {"include_usage": True}},
    {"prompt": "hi", "logit_bias": {"not-a-token": 1.0}},
    {"prompt": []},
    {"prompt": [999999]},
])
def test_bad_sampling_values_are_400(live_server, body):
    error = _error(_post(live_server, "/v1/completions", body), 400)
    assert error["message"]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
])
def test_bad_chat_requests_are_400(live_server, body):
    _error(_post(live_server, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "hi", "priority": 1}),
                                         ("/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "hi"}], "priority": -2})])
def test_a_priority_on_a_first_come_first_served_server_is_400(live_server, route, body):
    error = _error(_post(live_server, route, body), 400)
    assert "--scheduling-policy priority" in error["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400_with_both_numbers(live_server):
    error = _error(_post(live_server, "/v1/completions", {"prompt": "hello " * 20, "max_tokens": 500}), 400)
    assert "512" in error["message"] and "500" in error["message"]
    prompt_tokens = int(error["message"].split("(")[1].split(" ")[0])
    assert str(prompt_tokens + 500) in error["message"]
    chat = _error(_post(live_server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}), 400)
    assert "512" in chat["message"] and "600" in chat["message"]
    too_long = _error(_post(live_server, "/v1/completions", {"prompt": "word " * 600}), 400)
    assert "512" in too_long["message"]


def test_unknown_model_is_404(live_server):
    for path, body in (("/v1/completions", {"prompt": "hi", "model": "gpt-9"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"})):
        error = _error(_post(live_server, path, body), 404)
        assert "gpt-9" in error["message"] and error["code"] == "model_not_found"
    _error(httpx.get(f"{live_server.v1}/models/gpt-9", headers=live_server.headers), 404)
    _error(httpx.get(f"{live_server.url}/no/such/route", headers=live_server.headers), 404)


def test_embeddings_are_refused_for_a_generative_model(live_server):
    error = _error(_post(live_server, "/v1/embeddings", {"input": "hi"}), 400)
    assert "does not support embeddings" in error["message"]


def test_tokenize_and_detokenize_round_trip(live_server):
    tokens = _post(live_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert "".join(tokens["token_strs"]) == "Hello world"
    assert _post(live_server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    _error(_post(live_server, "/detokenize", {"tokens": [-1]}), 400)
    _error(_post(live_server, "/tokenize", {}), 400)


def test_prompts_and_outputs_are_logged_only_with_enable_log_requests(live_server, caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="jvllm")
    body = {"prompt": "my private prompt", "max_tokens": 2}
    assert _post(live_server, "/v1/completions", body).status_code == 200
    assert "my private prompt" not in caplog.text
    settings = live_server.app.state.jvllm.settings
    settings.enable_log_requests = True
    try:
        assert _post(live_server, "/v1/completions", body).status_code == 200
        assert "my private prompt" in caplog.text
        settings.max_log_len = 10  # --max-log-len: the logged prompt is cut, saying how much was left out
        caplog.clear()
        assert _post(live_server, "/v1/completions", {**body, "prompt": "a long prompt " * 20}).status_code == 200
        received = next(r.getMessage() for r in caplog.records if " received: " in r.getMessage())
        assert "'a long pr... (272 more characters)" in received and "a long prompt a long" not in received
    finally:
        settings.enable_log_requests, settings.max_log_len = False, 2000


def test_internal_errors_are_500_without_details(live_server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(live_server.engine, "tokenize", broken)
    reply = _post(live_server, "/v1/completions", {"prompt": "hi"})
    error = _error(reply, 500)
    assert "secret" not in reply.text and error["type"] == "server_error"


def test_a_failed_step_is_500_then_an_error_event_and_the_server_keeps_serving(live_server, monkeypatch):
    runner = live_server.engine.engine.runner
    real = runner.collect
    failing = True

    def flaky(*args, **kwargs):
        if failing:
            raise RuntimeError("device on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "collect", flaky)
    body = {"prompt": "fail me", "max_tokens": 3, "ignore_eos": True}
    _error(_post(live_server, "/v1/completions", body), 500)
    failing = False
    assert _post(live_server, "/v1/completions", body).status_code == 200  # the engine lives on
    failing = True
    with httpx.stream("POST", f"{live_server.v1}/completions", headers=live_server.headers, timeout=600,
                      json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data:")]
    assert '"error"' in events[-2] and "server_error" in events[-2]
    assert events[-1] == "data: [DONE]"
    failing = False
    assert httpx.get(f"{live_server.url}/health").status_code == 200
    assert _post(live_server, "/v1/completions", body).status_code == 200
