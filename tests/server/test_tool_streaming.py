"""Tool calls through the openai client: names first, arguments as they are decoded, calls cut by max_tokens partial."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "maxLength": 20}},
                                             "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# one call in each parser's format, forced by a Lark grammar without free whitespace (the tiny model writes noise
# otherwise, and whitespace for ever where the grammar allows it)
_CALL = json.dumps({"type": "object", "properties": {"name": {"const": "get_weather"},
                                                     "arguments": WEATHER["function"]["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False,
                    "x-guidance": {"whitespace_flexible": False}})
_LLAMA_CALL = _CALL.replace('"arguments"', '"parameters"')
FORMATS = {"hermes": f'start: "<tool_call>" %json{_CALL} "</tool_call>"',
           "llama3_json": f"start: %json{_LLAMA_CALL}",
           "mistral": f'start: "[TOOL_CALLS]" "[" %json{_CALL} "]"'}


def _stream(client, **kwargs):
    """-> (content, {index: (name, arguments, chunks with argument text)}, finish reason); checks that each call's
    id, type and name arrive in its first delta, with empty arguments, and never again."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name
                    assert call.function.arguments == ""
                    calls[call.index] = [call.function.name, "", 0]
                else:
                    assert call.id is None and call.type is None and call.function.name is None
                    calls[call.index][1] += call.function.arguments
                    calls[call.index][2] += bool(call.function.arguments)
            finish = choice.finish_reason or finish
    return content, {index: tuple(value) for index, value in calls.items()}, finish


def _whole(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, **kwargs).choices[0]


def _check_streamed_like_whole(client, finish, **kwargs):
    whole = _whole(client, **kwargs)
    assert whole.finish_reason == finish and whole.message.content is None and whole.message.tool_calls
    content, calls, streamed_finish = _stream(client, **kwargs)
    assert content == "" and streamed_finish == finish
    assert [(name, arguments) for name, arguments, _ in calls.values()] == [
        (call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    for name, arguments, chunks in calls.values():
        json.loads(arguments)
        assert chunks > 1, "the arguments came in one chunk"
    return whole, calls


# each with parallel_tool_calls=False: the tiny model would go on adding calls
FORCED = [([WEATHER, TIME], "required", "tool_calls"), ([WEATHER], "required", "tool_calls"),
          ([WEATHER, TIME], NAMED, "stop")]


@pytest.mark.parametrize("tools, tool_choice, finish", FORCED)
def test_forced_calls_stream_their_name_first_then_argument_fragments(client, tools, tool_choice, finish):
    whole, calls = _check_streamed_like_whole(client, finish, tools=tools, tool_choice=tool_choice, max_tokens=200,
                                              parallel_tool_calls=False)
    if tool_choice == NAMED or len(tools) == 1:
        assert [call.function.name for call in whole.message.tool_calls] == ["get_weather"]


def _check_cut(client, finish_whole, *, partial_name: str | None, **kwargs):
    """The same request whole and cut: the cut one ends with "length", no content, and a prefix of the call."""
    full = _whole(client, **kwargs, max_tokens=200)
    assert full.finish_reason == finish_whole
    partial_calls = 0
    for max_tokens in (3, 6, 12, 20):
        cut = _whole(client, **kwargs, max_tokens=max_tokens)
        content, calls, finish = _stream(client, **kwargs, max_tokens=max_tokens)
        assert cut.finish_reason == finish == "length"
        assert cut.message.content is None and content == ""
        assert [(call.function.name, call.function.arguments) for call in cut.message.tool_calls] == [
            (name, arguments) for name, arguments, _ in calls.values()]
        if partial_name is not None:  # the call's name is known before the cut
            assert [call.function.name for call in cut.message.tool_calls] == [partial_name]
        for partial, complete in zip(cut.message.tool_calls, full.message.tool_calls):
            assert partial.function.name == complete.function.name
            assert complete.function.arguments.startswith(partial.function.arguments)
            assert partial.function.arguments != complete.function.arguments
        partial_calls += len(cut.message.tool_calls)
    assert partial_calls


@pytest.mark.parametrize("tools, tool_choice, finish", FORCED)
def test_forced_calls_cut_by_max_tokens_are_partial_calls_never_content(client, tools, tool_choice, finish):
    """With one function to choose, or a named one, the call is named from the first token on."""
    name = "get_weather" if len(tools) == 1 or tool_choice == NAMED else None
    _check_cut(client, finish, partial_name=name, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False)


@pytest.fixture
def auto_parser(live_server, monkeypatch):
    """Turns on auto tool choice with a parser on the shared server for one test."""
    settings = live_server.app.state.jvllm.settings

    def use(parser: str) -> None:
        monkeypatch.setattr(settings, "enable_auto_tool_choice", True)
        monkeypatch.setattr(settings, "tool_call_parser", parser)

    return use


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_auto_parsers_stream_calls_as_they_are_written_and_cut_ones_stay_partial(client, auto_parser, parser):
    auto_parser(parser)
    forced = dict(tools=[WEATHER, TIME], extra_body={"structured_outputs": {"grammar": FORMATS[parser]}})
    whole, _ = _check_streamed_like_whole(client, "tool_calls", max_tokens=200, **forced)
    assert [call.function.name for call in whole.message.tool_calls] == ["get_weather"]
    assert json.loads(whole.message.tool_calls[0].function.arguments).keys() == {"city", "unit"}
    # a cut at 3 tokens may fall before the name is written: then neither a call nor content
    _check_cut(client, "tool_calls", partial_name=None, **forced)


def test_auto_text_replies_still_stream_as_content(client, auto_parser):
    auto_parser("hermes")
    kwargs = dict(tools=[WEATHER], max_tokens=24)
    whole = _whole(client, **kwargs)
    chunks = [chunk for chunk in client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                                                 stream=True, **kwargs)]
    pieces = [choice.delta.content for chunk in chunks for choice in chunk.choices if choice.delta.content]
    assert whole.message.tool_calls is None or whole.message.tool_calls == []
    assert "".join(pieces) == whole.message.content and len(pieces) > 1
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"
