"""The anthropic client against a live server: /v1/messages whole and streamed, tools, count_tokens, errors."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import API_KEY, MODEL

# no free whitespace in the forced calls' JSON: the tiny random model would write whitespace for ever
_FIXED = {"x-guidance": {"whitespace_flexible": False}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False, **_FIXED}}
TIME = {"name": "get_time", "description": "The time in a timezone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                         "required": ["zone"], "additionalProperties": False, **_FIXED}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# newer SDKs take no temperature argument: it goes in the body as an extra field
GREEDY = dict(model=MODEL, extra_body={"temperature": 0})


@pytest.fixture(scope="module")
def claude(live_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.url, api_key=API_KEY, max_retries=0, timeout=600)


def _tokenized(live_server, messages: list[dict], **extra) -> dict:
    reply = httpx.post(f"{live_server.url}/tokenize", headers=live_server.headers, json={"messages": messages, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _greedy(offline_engine, token_ids: list[int], max_tokens: int):
    from jvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return offline_engine.generate({"prompt_token_ids": token_ids}, params, use_tqdm=False)[0].outputs[0]


def _raw_events(live_server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/messages, read off the wire (key sent as x-api-key)."""
    body = {**{key: value for key, value in body.items() if key != "extra_body"}, **body.get("extra_body", {})}
    events, name = [], None
    with httpx.stream("POST", f"{live_server.url}/v1/messages", json={**body, "stream": True}, timeout=600,
                      headers={"x-api-key": API_KEY}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events


def _blocks(events: list[tuple[str, dict]]) -> tuple[list[dict], list[list[dict]], dict]:
    """Checks the event order (message_start, blocks started, deltaed and stopped one at a time, message_delta,
    message_stop) -> (each block's start, each block's deltas, the message_delta)."""
    assert all(name == data["type"] for name, data in events), events
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    starts, deltas, open_index = [], [], None
    for name, data in events[1:]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(starts)
            open_index = data["index"]
            starts.append(data["content_block"])
            deltas.append([])
        elif name == "content_block_delta":
            assert data["index"] == open_index
            deltas[open_index].append(data["delta"])
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif name in ("message_delta", "message_stop"):
            assert open_index is None
    assert names.count("message_start") == 1 and names.count("message_delta") == 1
    return starts, deltas, next(data for name, data in events if name == "message_delta")


def test_text_reply_is_the_offline_engines_greedy_output(claude, live_server, offline_engine):
    messages = [{"role": "user", "content": "Name a color."}]
    reply = claude.messages.create(max_tokens=12, system="Be brief.", messages=messages, **GREEDY)
    tokens = _tokenized(live_server, [{"role": "system", "content": "Be brief."}, *messages])["tokens"]
    expected = _greedy(offline_engine, tokens, 12)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == expected.text
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert reply.stop_sequence is None
    assert reply.usage.input_tokens == len(tokens) and reply.usage.output_tokens == len(expected.token_ids)


def test_a_final_assistant_message_is_continued(claude, live_server, offline_engine):
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    reply = claude.messages.create(max_tokens=6, messages=messages, **GREEDY)
    tokens = _tokenized(live_server, messages, add_generation_prompt=False, continue_final_message=True)["tokens"]
    assert reply.content[0].text == _greedy(offline_engine, tokens, 6).text
    assert reply.usage.input_tokens == len(tokens)


def test_stream_equals_the_whole_reply_and_its_events_are_well_formed(claude, live_server):
    body = dict(max_tokens=10, messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
                **GREEDY)
    whole = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = _raw_events(live_server, body)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    starts, deltas, end = _blocks(events)
    assert starts == [{"type": "text", "text": ""}]
    assert all(delta["type"] == "text_delta" for delta in deltas[0]) and len(deltas[0]) > 1
    assert "".join(delta["text"] for delta in deltas[0]) == whole.content[0].text
    assert end["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert end["usage"] == {"output_tokens": whole.usage.output_tokens}


def test_max_tokens_cut_is_stop_reason_max_tokens(claude):
    reply = claude.messages.create(max_tokens=2, messages=ASK, **GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 2


def test_stop_sequences_end_the_reply_with_stop_reason_stop_sequence(claude, live_server):
    long = claude.messages.create(max_tokens=16, messages=ASK, **GREEDY).content[0].text
    sequence = long[6:9]
    assert sequence.strip(), long
    reply = claude.messages.create(max_tokens=16, messages=ASK, stop_sequences=["never-written", sequence], **GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == sequence
    assert reply.content[0].text == long[:long.index(sequence)]
    _, _, end = _blocks(_raw_events(live_server, dict(max_tokens=16, messages=ASK, stop_sequences=[sequence],
                                                      **GREEDY)))
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": sequence}


@pytest.mark.parametrize("tool_choice, name", [({"type": "tool", "name": "get_time"}, "get_time"),
                                               ({"type": "any", "disable_parallel_tool_use": True}, None)])
def test_forced_tool_use_is_valid_input_whole_and_streamed_in_pieces(claude, live_server, tool_choice, name):
    body = dict(max_tokens=120, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, **GREEDY)
    whole = claude.messages.create(**body)
    assert whole.stop_reason == "tool_use" and [block.type for block in whole.content] == ["tool_use"]
    call = whole.content[0]
    assert call.id.startswith("toolu_") and call.name in ("get_weather", "get_time")
    assert name is None or call.name == name
    jsonschema.validate(call.input, {"get_weather": WEATHER, "get_time": TIME}[call.name]["input_schema"])
    starts, deltas, end = _blocks(_raw_events(live_server, body))
    assert len(starts) == 1 and starts[0]["type"] == "tool_use" and starts[0]["name"] == call.name
    assert starts[0]["input"] == {} and starts[0]["id"].startswith("toolu_")
    assert all(delta["type"] == "input_json_delta" for delta in deltas[0]) and len(deltas[0]) > 1
    assert json.loads("".join(delta["partial_json"] for delta in deltas[0])) == call.input
    assert end["delta"]["stop_reason"] == "tool_use"
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(block.type, block.name, block.input) for block in final.content] == [("tool_use", call.name, call.input)]


def _tool_turns(result: str, is_error: bool = False) -> list[dict]:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}
    return [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": is_error,
                                          "content": [{"type": "text", "text": result}]},
                                         {"type": "text", "text": "And tomorrow?"}]}]


def test_tool_results_render_as_the_chat_routes_tool_messages(claude, live_server):
    turns = _tool_turns("21 degrees and sunny")
    count = claude.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    chat = [*ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21 degrees and sunny"},
            {"role": "user", "content": "And tomorrow?"}]
    assert count == _tokenized(live_server, chat)["count"]
    longer = claude.messages.count_tokens(model=MODEL, messages=_tool_turns("21 degrees, sunny, a light breeze"))
    failed = claude.messages.count_tokens(model=MODEL, messages=_tool_turns("21 degrees and sunny", is_error=True))
    assert longer.input_tokens > count and failed.input_tokens > count
    without = claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert without < count
    reply = claude.messages.create(max_tokens=3, messages=turns, tools=[WEATHER], tool_choice={"type": "none"},
                                   **GREEDY)
    assert reply.usage.input_tokens >= count and reply.content[0].type == "text"


def test_count_tokens_is_the_chat_routes_prompt_count(claude, live_server):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": " Answer in one word."}]
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "Which "}, {"type": "text", "text": "color?"}]}]
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
    chat = [{"role": "system", "content": "You are terse. Answer in one word."}, messages[0], messages[1],
            {"role": "user", "content": "Which color?"}]
    assert counted == _tokenized(live_server, chat)["count"]
    reply = claude.messages.create(max_tokens=1, system=system, messages=messages, **GREEDY)
    assert reply.usage.input_tokens == counted


@pytest.mark.parametrize("body, words", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"max_tokens": 10**6, "messages": ASK}, "maximum context length"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                  "input": {}}]}]}, "assistant messages"),
])
def test_bad_requests_are_400_invalid_request_errors(claude, body, words):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", cast_to=object, body={"model": MODEL, **body})
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"]
    assert "Traceback" not in error["error"]["message"]


def test_malformed_large_and_misrouted_requests_answer_in_anthropic_shape(live_server):
    headers = {"x-api-key": API_KEY, "content-type": "application/json"}
    for method, path, status in (("POST", "/v1/messages", 400), ("POST", "/v1/messages/count_tokens", 400),
                                 ("GET", "/v1/messages", 405)):
        reply = httpx.request(method, f"{live_server.url}{path}", content=b'{"model": ', headers=headers)
        assert reply.status_code == status, reply.text
        assert reply.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": reply.json()["error"]["message"]}}
    limit = live_server.app.state.settings.max_request_body_bytes
    big = httpx.post(f"{live_server.url}/v1/messages", content=b" " * (limit + 1), headers=headers, timeout=120)
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"


def test_an_unknown_model_is_404_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_an_image_block_takes_the_chat_routes_image_path(claude, live_server):
    """Base64 and URL sources reach the chat route's image loading: this text-only model refuses both as it
    refuses an image_url part."""
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    url = f"data:image/png;base64,{pixel}"
    chat = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]})
    assert chat.status_code == 400
    for source in ({"type": "base64", "media_type": "image/png", "data": pixel}, {"type": "url", "url": url}):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]}], **GREEDY)
        assert caught.value.body["error"]["message"] == chat.json()["error"]["message"]


def test_the_key_goes_in_x_api_key_or_a_bearer_token_else_401(live_server):
    body = {"model": MODEL, "max_tokens": 1, "messages": ASK}
    wrong = anthropic.Anthropic(base_url=live_server.url, api_key="wrong-key", max_retries=0)
    for call in (lambda: wrong.messages.create(**body), lambda: wrong.messages.count_tokens(model=MODEL, messages=ASK)):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            call()
        assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                                "message": caught.value.body["error"]["message"]}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        missing = httpx.post(f"{live_server.url}{path}", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{live_server.url}/v1/messages", json=body, headers=live_server.headers, timeout=600)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    openai_route = httpx.post(f"{live_server.v1}/chat/completions", json=body, headers={"x-api-key": API_KEY})
    assert openai_route.status_code == 401 and "error" in openai_route.json()  # OpenAI's routes keep their shape


def test_a_failed_step_mid_stream_is_an_error_event(claude, live_server, monkeypatch):
    runner = live_server.engine.engine.runner
    real = runner.collect
    failing = {"on": False}

    def flaky(*args, **kwargs):
        if failing["on"]:
            raise RuntimeError("device on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "collect", flaky)
    failing["on"] = True
    with pytest.raises(anthropic.APIStatusError) as caught:
        with claude.messages.stream(max_tokens=4, messages=ASK, **GREEDY) as stream:
            stream.get_final_message()
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
    assert "device on fire" not in str(caught.value.body)
    failing["on"] = False
    assert claude.messages.create(max_tokens=2, messages=ASK, **GREEDY).type == "message"


def test_openapi_documents_both_routes_with_anthropic_errors(live_server):
    schema = httpx.get(f"{live_server.url}/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = schema["paths"][path]["post"]["responses"]
        assert responses["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
    assert "text/event-stream" in schema["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]
