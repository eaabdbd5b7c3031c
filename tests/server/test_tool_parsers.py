"""Tool-call parsers, the reasoning split, and streamed replies that reassemble to the whole reply (no model)."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from server.chat_reply import StreamedReply, one_entry_per_call, whole_reply
from server.reasoning import ReasoningStream, split_reasoning
from server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from server.tools import ToolPlan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _calls(reply):
    """(name, arguments as an object) of a ParsedReply's or a message's calls."""
    calls = reply.calls if hasattr(reply, "calls") else [call.function for call in reply.tool_calls]
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _raw(reply):
    return [(call.name, call.arguments) for call in reply.calls]


def test_hermes_finds_every_block_and_keeps_the_text_before():
    reply = HermesParser().parse('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                 '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert reply.content == "Let me look.\n"
    assert _calls(reply) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    unclosed = HermesParser().parse('<tool_call>{"name": "get_time", "arguments": {}}')
    assert unclosed.content is None and _calls(unclosed) == [("get_time", {})]
    broken = HermesParser().parse('<tool_call>{"name": "get_time", "arguments": </tool_call>Done.')
    assert _raw(broken) == [("get_time", "")] and broken.content == "Done."  # named, then broken: a partial call
    nameless = HermesParser().parse('Use <tool_call>{"tool": "get_time"}</tool_call> or <tool_call> tags.')
    assert nameless.calls == [] and nameless.content == 'Use <tool_call>{"tool": "get_time"}</tool_call> or ' \
                                                        '<tool_call> tags.'
    assert HermesParser().parse("Just text.").content == "Just text."


def test_llama3_json_reads_one_or_several_calls_and_leaves_prose_alone():
    one = Llama3JsonParser().parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert one.content is None and _calls(one) == [("get_weather", {"city": "Oslo"})]
    two = Llama3JsonParser().parse('{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                                   '"parameters": {"city": "Rome"}}')
    assert _calls(two) == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    prose = Llama3JsonParser().parse('The answer is {"a": 1}')
    assert prose.calls == [] and prose.content == 'The answer is {"a": 1}'
    trailing = Llama3JsonParser().parse('{"name": "x", "parameters": {}} and more')
    assert _calls(trailing) == [("x", {})] and trailing.content == "and more"


def test_mistral_reads_the_list_after_its_marker():
    reply = MistralParser().parse('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
                                  '{"name": "get_time", "arguments": "{}"}]')
    assert reply.content == "Sure. "
    assert _calls(reply) == [("get_weather", {"city": "Nice"}), ("get_time", {})]
    assert MistralParser().parse("[TOOL_CALLS] not json").calls == []
    single = MistralParser().parse('[TOOL_CALLS] {"arguments": {"city": "Nice"}, "name": "get_weather"}')
    assert _raw(single) == [("get_weather", '{"city": "Nice"}')]  # arguments before the name wait for it


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


def _tokens(text: str) -> list[str]:
    """Token-sized pieces: words, runs of spaces, single punctuation characters."""
    return re.findall(r"\w+|\s+|[^\w\s]", text)


HERMES = ToolPlan("auto", [WEATHER, TIME], parser=HermesParser())
PLANS = {
    "hermes": HERMES,
    "llama3_json": ToolPlan("auto", [WEATHER, TIME], parser=Llama3JsonParser()),
    "mistral": ToolPlan("auto", [WEATHER, TIME], parser=MistralParser()),
    "required": ToolPlan("required", [WEATHER, TIME]),
    "required_one": ToolPlan("required", [WEATHER]),
    "named": ToolPlan("named", [WEATHER], named="get_weather"),
}
CALL_REPLIES = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
              '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice, \\"FR\\" [x]"}}, '
               '{"name": "get_time", "arguments": "{\\"tz\\": \\"\\u00e9\\"}"}]',
    "required": '[  \n{\n  "name":"get_time",\r\n "parameters":\r\n { "timezone":"Europe/Berlin"}}, '
                '{"name": "get_weather", "parameters": {"city": "Bonn", "unit": "celsius"}}]',
    "required_one": '[{"name": "get_weather", "parameters": {"city": "Bonn", "unit": "celsius"}}]',
    "named": '{"city": "Lyon", "unit": "celsius"}',
}
EXPECTED_CALLS = {
    "hermes": [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
    "llama3_json": [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    "mistral": [("get_weather", {"city": 'Nice, "FR" [x]'}), ("get_time", {"tz": "\u00e9"})],
    "required": [("get_time", {"timezone": "Europe/Berlin"}), ("get_weather", {"city": "Bonn", "unit": "celsius"})],
    "required_one": [("get_weather", {"city": "Bonn", "unit": "celsius"})],
    "named": [("get_weather", {"city": "Lyon", "unit": "celsius"})],
}
TEXT_REPLIES = ["<think>I should check the weather.</think>Let me look.\n<tool_call>{\"name\": \"get_weather\", "
                "\"arguments\": {\"city\": \"Paris\"}}</tool_call>",
                "<think>nothing to call</think>It is sunny <tool today.", "plain </thi answer without tags",
                "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>", "  ", ""]


def _streamed(plan, reasoning_parser, pieces, finish_reason="stop"):
    """Feeds the pieces -> (reasoning, content, {index: [name, arguments, deltas with argument text]}, the
    finish reason). Checks that each call's id, type and name come in its first delta and only there."""
    stream = StreamedReply(plan, reasoning_parser)
    reasoning, content, calls = "", "", {}
    deltas = [stream.start()]
    deltas += [stream.feed(piece, i == len(pieces) - 1, cut=finish_reason == "length")
               for i, piece in enumerate(pieces)]
    for delta in [part for delta in deltas if delta is not None for part in one_entry_per_call(delta)]:
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        assert len({call.index for call in delta.tool_calls or []}) == len(delta.tool_calls or [])
        for call in delta.tool_calls or []:
            first = call.index not in calls
            assert (call.id is not None, call.type, call.function.name is not None) == (
                (True, "function", True) if first else (False, None, False))
            assert not first or call.function.arguments == "", "a call's first delta has empty arguments"
            entry = calls.setdefault(call.index, [call.function.name, "", 0])
            entry[1] += call.function.arguments
            entry[2] += bool(call.function.arguments)
    assert sorted(calls) == list(range(len(calls)))
    return reasoning, content, calls, stream.finish_reason(finish_reason)


def _check_reassembles(plan, reasoning_parser, text, pieces, finish_reason="stop"):
    message, finish = whole_reply(text, plan, reasoning_parser, finish_reason)
    reasoning, content, calls, streamed_finish = _streamed(plan, reasoning_parser, pieces, finish_reason)
    assert reasoning == (message.reasoning_content or "")
    assert content == (message.content or "")
    assert [(name, arguments) for name, arguments, _ in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert streamed_finish == finish
    return message, finish


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(TEXT_REPLIES), st.lists(st.integers(0, 200), max_size=12),
       st.sampled_from([None, "deepseek_r1", "qwen3"]))
def test_auto_stream_deltas_reassemble_to_the_whole_reply(text, cuts, reasoning_parser):
    _check_reassembles(HERMES, reasoning_parser, text, _pieces(text, cuts))


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(PLANS)), st.lists(st.integers(0, 260), max_size=14))
def test_every_layout_streams_calls_that_reassemble_to_the_whole_reply(kind, cuts):
    text = CALL_REPLIES[kind]
    message, finish = _check_reassembles(PLANS[kind], None, text, _pieces(text, cuts))
    assert _calls(message) == EXPECTED_CALLS[kind]
    assert finish == ("stop" if kind == "named" else "tool_calls")
    assert message.content == {"hermes": "Let me look.\n", "mistral": "Sure. "}.get(kind)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_each_token_of_argument_text_is_one_delta(kind):
    """Fed token by token, a call's arguments come in one delta per token that holds some of their text."""
    text = CALL_REPLIES[kind]
    tokens = _tokens(text)
    _, _, calls, _ = _streamed(PLANS[kind], None, tokens)
    position = 0
    for _, arguments, deltas in calls.values():
        start = text.find(arguments, position)
        if start < 0:  # arguments the model encoded as a JSON string: decoded as they come
            assert deltas >= 1
            continue
        end, offset, holding = start + len(arguments), 0, 0
        for token in tokens:
            holding += start < offset + len(token) and offset < end
            offset += len(token)
        assert deltas == holding
        position = end
    assert sum(deltas for _, _, deltas in calls.values()) > len(calls)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_a_reply_cut_anywhere_leaves_partial_calls_and_no_scaffolding_in_content(kind):
    text, plan = CALL_REPLIES[kind], PLANS[kind]
    full, _ = whole_reply(text, plan, None, "stop")
    head = full.content or ""
    layout = plan.layout()
    opener = layout and (layout.marker or layout.prefix)
    for size in range(len(text) + 1):
        cut = text[:size]
        message, finish = _check_reassembles(plan, None, cut, _tokens(cut) or [""], "length")
        assert finish == "length"
        assert head.startswith(message.content or "")
        if size < len(text):  # the same text at the model's own end: a marker begun at the end is content
            message_at_end, _ = _check_reassembles(plan, None, cut, _tokens(cut) or [""])
            content = message_at_end.content or ""
            if not head.startswith(content):
                assert content.startswith(head) and opener and opener.startswith(content[len(head):])
        assert len(message.tool_calls) <= len(full.tool_calls)
        for partial, whole in zip(message.tool_calls, full.tool_calls):
            assert partial.function.name == whole.function.name
            assert whole.function.arguments.startswith(partial.function.arguments)
        if kind in ("named", "required_one"):  # the grammar makes the call and its name certain from the start
            assert len(message.tool_calls) == 1


NOISE = '{}[]",:; \\\nu0dD8<>/|_namergpsTOLCS'


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(PLANS)), st.lists(st.tuples(st.integers(0, 300), st.sampled_from([*NOISE, ""])),
                                                 max_size=6), st.lists(st.integers(0, 300), max_size=8))
def test_damaged_calls_stream_as_they_read_whole(kind, edits, cuts):
    """Malformed and half-formed calls too: the stream never fails and reassembles to the whole reply."""
    text = CALL_REPLIES[kind]
    for position, char in edits:
        position %= len(text) + 1
        text = text[:position] + char + text[position + 1:]
    for finish_reason in ("stop", "length"):
        _check_reassembles(PLANS[kind], None, text, _pieces(text, cuts), finish_reason)


def test_forced_calls_are_named_before_any_text():
    for kind in ("named", "required_one"):
        opening = StreamedReply(PLANS[kind], None).start()
        assert [(call.index, call.function.name, call.function.arguments) for call in opening.tool_calls] == [
            (0, "get_weather", "")]
    assert StreamedReply(PLANS["required"], None).start() is None
    assert StreamedReply(PLANS["hermes"], None).start() is None


@pytest.mark.parametrize("kind", ["hermes", "llama3_json", "mistral", "required"])
def test_a_call_named_and_begun_in_one_step_streams_its_header_then_its_text(kind):
    """A whole reply decoded in one step (forced tokens, or a stream reader that fell behind): each call's header
    goes out alone, with empty arguments, then its argument text."""
    delta = StreamedReply(PLANS[kind], None).feed(CALL_REPLIES[kind], final=True)
    parts = one_entry_per_call(delta)
    assert len(parts) > 1
    headers = [(call.index, call.function.arguments) for part in parts for call in part.tool_calls or []
               if call.id is not None]
    assert headers == [(index, "") for index in range(len(EXPECTED_CALLS[kind]))]
    for part in parts:
        indices = [call.index for call in part.tool_calls or []]
        assert len(set(indices)) == len(indices)


def test_reasoning_stream_holds_back_a_partial_closing_tag():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>abc</th") == ("abc", "")
    assert stream.feed("ink>done") == ("", "done")
