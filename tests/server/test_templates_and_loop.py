"""Request work off the event loop, request chat templates behind a flag and a time bound, OpenAPI, CORS."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server.blocking import TemplateTimeout, with_deadline
from tests.server.conftest import API_KEY, MODEL

USER = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def trusting_app(live_server):
    """A second app on the main server's engine that accepts request templates (no lifespan: it never
    shuts the shared engine down); reached in-process through httpx's ASGI transport."""
    from server.app import build_app
    from server.settings import ServerSettings

    return build_app(live_server.engine, ServerSettings([MODEL], api_key=API_KEY, trust_request_chat_template=True,
                                                        allowed_origins=["https://ok.example"]))


def _call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
            return await client.request(method, path, headers={"Authorization": f"Bearer {API_KEY}",
                                                               **kwargs.pop("headers", {})}, **kwargs)

    return asyncio.run(call())


def test_tokenizing_runs_off_the_event_loop(live_server, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = live_server.engine.tokenize

    def blocked(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(live_server.engine, "tokenize", blocked)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(reply=httpx.post(
        f"{live_server.url}/tokenize", headers=live_server.headers, json={"prompt": "a long prompt"}, timeout=120)))
    worker.start()
    try:
        assert entered.wait(30)
        health = httpx.get(f"{live_server.url}/health", timeout=5)  # answered while tokenizing is stuck
        assert health.status_code == 200
    finally:
        release.set()
        worker.join(60)
    assert result["reply"].status_code == 200 and result["reply"].json()["count"] == len(real("a long prompt"))


def test_a_request_chat_template_needs_the_trust_flag(live_server):
    for path, body in (("/v1/chat/completions", {"messages": USER, "chat_template": "{{ 'x' }}"}),
                       ("/tokenize", {"messages": USER, "chat_template": "{{ 'x' }}"})):
        reply = httpx.post(f"{live_server.url}{path}", headers=live_server.headers, json=body, timeout=60)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


def test_trusted_request_templates_render_within_time_and_size_bounds(trusting_app):
    plain = _call(trusting_app, "POST", "/tokenize",
                        json={"messages": USER, "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"})
    assert plain.status_code == 200 and plain.json()["count"] > 0
    started = time.perf_counter()
    looping = _call(trusting_app, "POST", "/tokenize", json={"messages": USER, "chat_template": NESTED_LOOPS})
    assert looping.status_code == 400 and "ran longer than" in looping.json()["error"]["message"]
    huge = _call(trusting_app, "POST", "/v1/chat/completions",
                       json={"messages": USER, "chat_template": "{{ 'a' * 5000000 }}"})
    assert huge.status_code == 400 and "characters" in huge.json()["error"]["message"]
    assert time.perf_counter() - started < 3.0


def test_with_deadline_stops_template_loops_and_leaves_other_code_alone():
    import jinja2.sandbox

    template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(NESTED_LOOPS)
    started = time.perf_counter()
    with pytest.raises(TemplateTimeout):
        with_deadline(template.render, 0.2)
    assert time.perf_counter() - started < 2.0
    assert with_deadline(lambda: sum(range(10**6)), 0.0) == sum(range(10**6))  # not template code: untouched


def test_openapi_describes_streamed_responses_event_by_event(live_server):
    import schemathesis

    document = httpx.get(f"{live_server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        assert content["text/event-stream"]["schema"]["required"] == ["data"]
    schema = schemathesis.openapi.from_url(f"{live_server.url}/openapi.json")
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "stream": True,
                                                 "stream_options": {"include_usage": True}})):
        case = schema[path]["POST"].Case(body=body, headers={"Authorization": f"Bearer {API_KEY}"},
                                         media_type="application/json")
        response = case.call()
        assert response.headers["content-type"][0].startswith("text/event-stream")
        case.validate_response(response)  # every event: a chunk, an error object or [DONE]


def test_cors_preflight_follows_the_allowed_origins(live_server, trusting_app):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    open_reply = httpx.options(f"{live_server.v1}/chat/completions", headers=preflight)
    assert open_reply.status_code == 200 and open_reply.headers["access-control-allow-origin"] == "*"
    narrowed = (_call(trusting_app, "OPTIONS", "/v1/chat/completions", headers=preflight))
    assert narrowed.status_code == 400 and "access-control-allow-origin" not in narrowed.headers
    allowed = (_call(trusting_app, "OPTIONS", "/v1/chat/completions",
                                headers={**preflight, "Origin": "https://ok.example"}))
    assert allowed.headers["access-control-allow-origin"] == "https://ok.example"
