"""response_format and structured_outputs through the OpenAI client against a server on the default model."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest

from tests.server.conftest import API_KEY, MODEL, start_server

pytestmark = pytest.mark.slow


# A Hermes-style ChatML template that renders tools, assistant tool calls and tool results.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call functions. For each call write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
                                             "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Europe/Berlin?"}]


@pytest.fixture(scope="module")
def smol_server():
    """SmolLM2 in the default dtype (shapes compile when first met), the Hermes template, auto tool choice with
    the hermes parser, and the qwen3 reasoning parser."""
    server = start_server(None, engine_args=dict(kv_cache_memory_bytes=256 << 20, max_num_seqs=32,
                                                 max_model_len=2048, reasoning_parser="qwen3", precompile=False),
                          settings=dict(chat_template=HERMES_TEMPLATE, enable_auto_tool_choice=True,
                                        tool_call_parser="hermes", reasoning_parser="qwen3"))
    yield server
    server.stop()


@pytest.fixture
def smol(smol_server):
    return openai.OpenAI(base_url=smol_server.v1, api_key=API_KEY, max_retries=0, timeout=600)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: int = pydantic.Field(ge=0, le=50)


def test_parse_returns_the_pydantic_object(smol):
    reply = smol.chat.completions.parse(model=MODEL, response_format=City, temperature=0, max_tokens=120,
                                        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert City.model_validate_json(message.content) == message.parsed


def test_json_object_and_streamed_json_schema_replies(smol):
    reply = smol.chat.completions.create(model=MODEL, response_format={"type": "json_object"}, temperature=0,
                                         max_tokens=200, messages=[{"role": "user", "content": "Reply with a small "
                                                                    "JSON object with the keys a and b."}])
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Pick a colour and a count."}]
    whole = smol.chat.completions.create(model=MODEL, response_format=response_format, temperature=0,
                                         max_tokens=60, messages=messages).choices[0].message.content
    pieces = [chunk.choices[0].delta.content or "" for chunk in smol.chat.completions.create(
        model=MODEL, response_format=response_format, temperature=0, max_tokens=60, messages=messages, stream=True)
        if chunk.choices]
    assert "".join(pieces) == whole
    assert json.loads(whole)["colour"] in ("red", "green", "blue")


def test_structured_outputs_field_on_completions(smol):
    regex = smol.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.7, seed=2,
                                    extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    choice = smol.completions.create(model=MODEL, prompt=["Is water wet?", "Is fire cold?"], max_tokens=5,
                                     temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert [c.text for c in choice.choices] in (["yes", "no"], ["yes", "yes"], ["no", "no"], ["no", "yes"])
    lark = smol.completions.create(model=MODEL, prompt="Digits:", max_tokens=20, temperature=0,
                                   extra_body={"structured_outputs": {"grammar": 'start: /[0-9]{4}/'}})
    assert re.fullmatch("[0-9]{4}", lark.choices[0].text)


@pytest.mark.parametrize("route, extra, param, words", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "not": {"type": "string"}}}}}, "response_format", "not"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "json_schema.schema"),
    ("chat", {"response_format": {"type": "xml"}}, None, "response_format"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regular expression"),
    ("completions", {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "grammar"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("chat", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
])
def test_bad_constraints_are_400s_naming_the_field(smol_server, route, extra, param, words):
    if route == "chat":
        url, body = "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        url, body = "/completions", {"prompt": "hi"}
    reply = httpx.post(f"{smol_server.v1}{url}", json={"model": MODEL, **body, **extra}, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def _check_calls(calls, finish_reason, expected_finish):
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    assert calls and finish_reason == expected_finish
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _streamed_calls(smol, **kwargs):
    """(name, arguments) of each streamed call, its argument fragments joined, and the finish reason; checks that
    each call's arguments came in several chunks (one per token that adds to them)."""
    calls: dict[int, list[str]] = {}
    chunks: dict[int, int] = {}
    finish = None
    for chunk in smol.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
                chunks[call.index] = chunks.get(call.index, 0) + bool(call.function.arguments)
            finish = choice.finish_reason or finish
    assert all(count > 1 for count in chunks.values()), chunks
    return [tuple(calls[index]) for index in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice, finish", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_required_and_named_tool_choice_give_valid_calls_whole_and_streamed(smol, tool_choice, finish):
    kwargs = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0, max_tokens=150)
    reply = smol.chat.completions.create(model=MODEL, **kwargs)
    message = reply.choices[0].message
    _check_calls(message.tool_calls, reply.choices[0].finish_reason, finish)
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in message.tool_calls] == ["get_time"]
    streamed, streamed_finish = _streamed_calls(smol, **kwargs)
    assert streamed == [(call.function.name, call.function.arguments) for call in message.tool_calls]
    assert streamed_finish == finish


def test_auto_tool_choice_parses_hermes_calls_the_model_writes(smol):
    """The reply is steered into Hermes' format by a grammar; the hermes parser turns it into OpenAI's calls."""
    schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                               "arguments": WEATHER["function"]["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
    grammar = f'start: "<tool_call>" %json{json.dumps(schema)} "</tool_call>"'
    kwargs = dict(messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=150,
                  extra_body={"structured_outputs": {"grammar": grammar}})
    reply = smol.chat.completions.create(model=MODEL, **kwargs)
    _check_calls(reply.choices[0].message.tool_calls, reply.choices[0].finish_reason, "tool_calls")
    assert reply.choices[0].message.content is None
    streamed, finish = _streamed_calls(smol, **kwargs)
    assert streamed == [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert finish == "tool_calls"


def test_tool_history_reaches_the_template(smol, smol_server):
    from server.chat import conversation
    from server.protocol import ChatMessage

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21 degrees and sunny"}]
    text = smol_server.engine.apply_chat_template(
        conversation([ChatMessage.model_validate(m) for m in history]), tools=[WEATHER, TIME],
        chat_template=HERMES_TEMPLATE, add_generation_prompt=True)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<tool_response>\n21 degrees and sunny" in text and '"name": "get_time"' in text
    with_tools = smol.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                              max_tokens=4, temperature=0)
    without = smol.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens  # the tools were rendered


@pytest.mark.parametrize("extra, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice", "get_stock"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tool_choice": "required", "tools": [WEATHER, WEATHER]}, "tools", "unique"),
])
def test_bad_tool_requests_are_400s(smol_server, extra, param, words):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], **extra}
    reply = httpx.post(f"{smol_server.v1}/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and words in reply.json()["error"]["message"]


def test_auto_tool_choice_needs_the_server_flags(live_server):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER]}
    reply = httpx.post(f"{live_server.v1}/chat/completions", json=body, timeout=60, headers=live_server.headers)
    assert reply.status_code == 400
    assert "--enable-auto-tool-choice" in reply.json()["error"]["message"]
