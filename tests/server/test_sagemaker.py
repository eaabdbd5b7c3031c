"""SageMaker's routes (vLLM's server has them): /ping answers as /health; /invocations takes a chat, completion or
embedding body and answers as that body's own route does; the API key guards it as it guards /v1."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL


def _post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**server.headers, **headers}, timeout=600)


def test_ping_answers_as_health(live_server):
    assert httpx.get(f"{live_server.url}/ping").status_code == 200
    assert httpx.post(f"{live_server.url}/ping").status_code == 200


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
                              "max_tokens": 6, "temperature": 0}),
    ("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}),
])
def test_invocations_answer_as_the_bodys_own_route(live_server, route, body):
    own, invoked = _post(live_server, route, body).json(), _post(live_server, "/invocations", body).json()
    assert invoked["object"] == own["object"] and invoked["usage"] == own["usage"]
    assert invoked["choices"] == own["choices"]  # greedy: the same reply


def test_streamed_invocations_stream(live_server):
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live_server.url}/invocations", json=body, headers=live_server.headers) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2


def test_bad_invocations_are_400_and_the_key_is_required(live_server):
    for body in ({"model": MODEL}, {"messages": "not a list"}):
        reply = _post(live_server, "/invocations", body)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    not_json = httpx.post(f"{live_server.url}/invocations", content=b"{oops", headers=live_server.headers)
    assert not_json.status_code == 400
    assert httpx.post(f"{live_server.url}/invocations", json={"prompt": "hi"}).status_code == 401


def test_deeply_nested_json_is_a_400_not_a_crash(live_server):
    deep = b"[" * 200_000 + b"]" * 200_000  # past Python's recursion limit in any JSON parser that recurses
    for route in ("/invocations", "/v1/completions"):
        reply = httpx.post(f"{live_server.url}{route}", content=deep, timeout=60,
                           headers={**live_server.headers, "Content-Type": "application/json"})
        assert reply.status_code == 400, (route, reply.status_code, reply.text[:200])
    assert httpx.get(f"{live_server.url}/health").status_code == 200
