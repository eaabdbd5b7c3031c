"""Tool-call parsers, the reasoning split, and streamed replies that reassemble to the whole reply (no model)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from server.chat_reply import StreamedReply, whole_reply
from server.reasoning import ReasoningStream, split_reasoning
from server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from server.tools import ToolPlan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _calls(reply):
    return [(call.name, json.loads(call.arguments)) for call in reply.calls]


def test_hermes_finds_every_block_and_keeps_the_text_before():
    reply = HermesParser().parse('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                 '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert reply.content == "Let me look.\n"
    assert _calls(reply) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    unclosed = HermesParser().parse('<tool_call>{"name": "get_time", "arguments": {}}')
    assert unclosed.content is None and _calls(unclosed) == [("get_time", {})]
    broken = HermesParser().parse('<tool_call>{"name": "get_time", "arguments": </tool_call>')
    assert broken.calls == [] and broken.content.startswith("<tool_call>")
    assert HermesParser().parse("Just text.").content == "Just text."


def test_llama3_json_reads_one_or_several_calls_and_leaves_prose_alone():
    one = Llama3JsonParser().parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert one.content is None and _calls(one) == [("get_weather", {"city": "Oslo"})]
    two = Llama3JsonParser().parse('{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                                   '"parameters": {"city": "Rome"}}')
    assert _calls(two) == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    prose = Llama3JsonParser().parse('The answer is {"a": 1}')
    assert prose.calls == [] and prose.content == 'The answer is {"a": 1}'
    assert Llama3JsonParser().parse('{"name": "x", "parameters": {}} and more').calls == []


def test_mistral_reads_the_list_after_its_marker():
    reply = MistralParser().parse('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
                                  '{"name": "get_time", "arguments": "{}"}]')
    assert reply.content == "Sure. "
    assert _calls(reply) == [("get_weather", {"city": "Nice"}), ("get_time", {})]
    assert MistralParser().parse("[TOOL_CALLS] not json").calls == []


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("qwen3", "<think>plan</think>answer", "plan", "answer"),
    ("qwen3", "no thoughts here", None, "no thoughts here"),
])
def test_reasoning_split(parser, text, reasoning, content):
    split = split_reasoning(parser, text)
    assert (split.reasoning, split.content) == (reasoning, content)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


REPLIES = ["<think>I should check the weather.</think>Let me look.\n<tool_call>{\"name\": \"get_weather\", "
           "\"arguments\": {\"city\": \"Paris\"}}</tool_call>",
           "<think>nothing to call</think>It is sunny <tool today.", "plain </thi answer without tags",
           "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>"]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 200), max_size=12),
       st.sampled_from([None, "deepseek_r1", "qwen3"]))
def test_auto_stream_deltas_reassemble_to_the_whole_reply(text, cuts, reasoning_parser):
    plan = ToolPlan("auto", [WEATHER, TIME], parser=HermesParser())
    message, finish = whole_reply(text, plan, reasoning_parser, "stop")
    stream = StreamedReply(plan, reasoning_parser)
    pieces = _pieces(text, cuts)
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
    assert reasoning == (message.reasoning_content or "")
    assert content == (message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert stream.finish_reason("stop") == finish


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=8))
def test_named_and_required_streams_reassemble(cuts):
    named = ToolPlan("named", [WEATHER], named="get_weather")
    text = '{"city": "Lyon"}'
    stream, arguments, names = StreamedReply(named, None), "", []
    pieces = _pieces(text, cuts)
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        for call in (delta.tool_calls or []) if delta else []:
            arguments += call.function.arguments or ""
            names += [call.function.name] if call.function.name else []
    message, finish = whole_reply(text, named, None, "stop")
    assert names == ["get_weather"] and arguments == message.tool_calls[0].function.arguments == text
    assert finish == "stop" and stream.finish_reason("stop") == "stop"

    required = ToolPlan("required", [WEATHER, TIME])
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Bonn"}}]'
    stream, calls = StreamedReply(required, None), []
    pieces = _pieces(text, cuts)
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        assert delta is None or not delta.content
        calls += [(c.index, c.function.name, json.loads(c.function.arguments))
                  for c in ((delta.tool_calls or []) if delta else [])]
    assert calls == [(0, "get_time", {}), (1, "get_weather", {"city": "Bonn"})]
    assert stream.finish_reason("stop") == "tool_calls"


def test_reasoning_stream_holds_back_a_partial_closing_tag():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>abc</th") == ("abc", "")
    assert stream.feed("ink>done") == ("", "done")
