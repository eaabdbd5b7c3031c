"""Server options as vLLM's server spells them: `--default-chat-template-kwargs` (under a request's own
chat_template_kwargs), `--enable-request-id-headers`, `--disable-fastapi-docs`, `--enable-force-include-usage`,
`--return-tokens-as-token-ids` (under a request's own), several `--api-key`s and `--uds`."""
from __future__ import annotations

import re
import socket

import httpx
import pytest

from server.settings import ServerSettings
from tests.server.conftest import API_KEY, MODEL, start_server
from tests.server.minimal_app import serving

SECOND_KEY = "sk-second-key"
# A template whose output shows the keyword it was given: the greeting, then each message's text.
TEMPLATE = "{{ greeting }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def optioned(tiny_llama):
    server = start_server(tiny_llama, settings={
        "chat_template": TEMPLATE, "default_chat_template_kwargs": {"greeting": "Hello there. "},
        "enable_request_id_headers": True, "disable_fastapi_docs": True, "enable_force_include_usage": True,
        "return_tokens_as_token_ids": True, "api_key": [API_KEY, SECOND_KEY]})
    yield server
    server.stop()


def _ids(server, text: str) -> list[int]:
    reply = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                       headers=server.headers)
    return reply.json()["tokens"]


def test_default_template_keywords_apply_under_the_requests_own(optioned):
    messages = [{"role": "user", "content": "How are you?"}]
    rendered = httpx.post(f"{optioned.url}/tokenize", json={"messages": messages}, headers=optioned.headers).json()
    assert rendered["tokens"] == _ids(optioned, "Hello there. How are you?")  # the server's default
    asked = httpx.post(f"{optioned.url}/tokenize", headers=optioned.headers,
                       json={"messages": messages, "chat_template_kwargs": {"greeting": "Hi. "}}).json()
    assert asked["tokens"] == _ids(optioned, "Hi. How are you?")
    chat = {"model": MODEL, "messages": messages, "max_tokens": 1}
    default = httpx.post(f"{optioned.v1}/chat/completions", json=chat, headers=optioned.headers).json()
    assert default["usage"]["prompt_tokens"] == len(_ids(optioned, "Hello there. How are you?"))
    own = httpx.post(f"{optioned.v1}/chat/completions", headers=optioned.headers,
                     json={**chat, "chat_template_kwargs": {"greeting": "Good evening, dear friend. "}}).json()
    assert own["usage"]["prompt_tokens"] == len(_ids(optioned, "Good evening, dear friend. How are you?"))


def test_every_response_carries_a_request_id(optioned, live_server):
    fresh = httpx.get(f"{optioned.v1}/models", headers=optioned.headers)
    other = httpx.get(f"{optioned.v1}/models", headers=optioned.headers)
    assert len(fresh.headers["x-request-id"]) == 32 and fresh.headers["x-request-id"] != other.headers["x-request-id"]
    mine = httpx.get(f"{optioned.v1}/models", headers={**optioned.headers, "X-Request-Id": "client-42"})
    assert mine.headers["x-request-id"] == "client-42"
    too_long = httpx.get(f"{optioned.v1}/models", headers={**optioned.headers, "X-Request-Id": "x" * 200})
    assert len(too_long.headers["x-request-id"]) == 32
    refused = httpx.get(f"{optioned.v1}/models")  # errors too (no API key: 401)
    assert refused.status_code == 401 and "x-request-id" in refused.headers
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{optioned.v1}/completions", json=body,
                      headers={**optioned.headers, "X-Request-Id": "stream-7"}) as streamed:
        assert streamed.headers["x-request-id"] == "stream-7"
        assert streamed.read().decode().rstrip().endswith("data: [DONE]")
    assert "x-request-id" not in httpx.get(f"{live_server.v1}/models", headers=live_server.headers).headers


def test_the_docs_can_be_turned_off(optioned, live_server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{optioned.url}{path}").status_code == 404
        assert httpx.get(f"{live_server.url}{path}").status_code == 200
    assert httpx.get(f"{optioned.v1}/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_forced_usage_ends_every_stream(optioned, live_server, route):
    from openai import OpenAI

    def last_chunk(server):
        with OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0) as client:
            if route == "chat":
                chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=5, temperature=0, stream=True)
            else:
                chunks = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, stream=True)
            return list(chunks)[-1]

    forced = last_chunk(optioned)  # no stream_options in the request
    assert forced.choices == [] and forced.usage.completion_tokens == 5
    assert last_chunk(live_server).usage is None


def test_logprobs_name_tokens_by_id_unless_the_request_says_otherwise(optioned, live_server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "logprobs": 1}

    def reply(server, **extra) -> tuple[str, list[str]]:
        choice = httpx.post(f"{server.v1}/completions", json={**body, **extra}, headers=server.headers).json()
        return choice["choices"][0]["text"], choice["choices"][0]["logprobs"]["tokens"]

    text, by_id = reply(optioned)
    assert all(re.fullmatch(r"token_id:\d+", token) for token in by_id)
    ids = [int(token.split(":")[1]) for token in by_id]
    assert httpx.post(f"{optioned.url}/detokenize", json={"tokens": ids}, headers=optioned.headers).json() == {
        "prompt": text}
    _, named = reply(optioned, return_tokens_as_token_ids=False)  # the request's own choice wins
    assert "".join(named) == text and not any(token.startswith("token_id:") for token in named)
    assert reply(live_server, return_tokens_as_token_ids=True)[1] == by_id  # a server without the flag


def test_any_of_several_api_keys_is_accepted(optioned):
    def status(headers: dict, route: str = "/v1/models") -> int:
        return httpx.get(f"{optioned.url}{route}", headers=headers).status_code

    for key in (API_KEY, SECOND_KEY):
        assert status({"Authorization": f"Bearer {key}"}) == 200
    assert status({"Authorization": "Bearer sk-neither"}) == 401
    assert status({"Authorization": f"Bearer {API_KEY}{SECOND_KEY}"}) == 401
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    anthropic = httpx.post(f"{optioned.v1}/messages", json=messages, headers={"x-api-key": SECOND_KEY})
    assert anthropic.status_code == 200


def test_the_cli_takes_several_api_keys():
    from entrypoints.cli import build_parser
    from jvllm.engine.arg_utils import dataclass_from_flags

    args = build_parser().parse_args(["serve", "--api-key", "sk-a", "sk-b"])
    assert dataclass_from_flags(ServerSettings, args, served_model_names=["m"]).api_keys == (b"sk-a", b"sk-b")
    assert ServerSettings(["m"], api_key="sk-one").api_keys == (b"sk-one",)  # $JVLLM_API_KEY's one key
    assert ServerSettings(["m"]).api_keys == ()


def test_the_server_listens_on_a_unix_socket(tmp_path):
    path = str(tmp_path / "jvllm.sock")
    assert ServerSettings(["m"], uds=path).address == f"unix socket {path}"
    with serving(uds=path):
        with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as client:
            assert client.get("http://jvllm/").text == "ok"
        with pytest.raises(OSError):  # not on the TCP port
            socket.create_connection(("127.0.0.1", ServerSettings(["m"]).port), timeout=1).close()
