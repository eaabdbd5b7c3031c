"""Templates that ignore `tools`: the server logs it once, and --tools-in-system-prompt describes them instead."""
from __future__ import annotations

import json
import logging

import pytest

from server.tool_prompt import template_renders_tools, tools_description, with_tools_described
from tests.server.conftest import MODEL, LogRecords
from tests.server.test_tool_streaming import ASK, TIME, WEATHER


def test_a_template_that_ignores_tools_is_told_apart_from_one_that_renders_them():
    def ignoring(messages, tools):
        return json.dumps(messages)

    def rendering(messages, tools):
        return json.dumps([messages, tools])

    assert not template_renders_tools(ignoring)
    assert template_renders_tools(rendering)


@pytest.mark.parametrize("parser, marker", [("hermes", "<tool_call>"), ("llama3_json", '"parameters"'),
                                            ("mistral", "[TOOL_CALLS]"), (None, None)])
def test_the_description_lists_each_function_and_the_parsers_call_format(parser, marker):
    text = tools_description([WEATHER, TIME], parser)
    lines = text.splitlines()
    assert json.loads(lines[1]) == WEATHER["function"] and json.loads(lines[2]) == TIME["function"]
    if marker is None:
        assert len(lines) == 3  # required/named calls are written by the grammar: no format to teach
    else:
        assert marker in lines[3]


def test_the_description_leads_an_existing_system_message_or_becomes_one():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    described = with_tools_described(chat, "TOOLS")
    assert described == [{"role": "system", "content": "TOOLS\n\nBe brief."}, chat[1]]
    assert chat[0]["content"] == "Be brief."  # the request's messages are left as they were
    assert with_tools_described(chat[1:], "TOOLS") == [{"role": "system", "content": "TOOLS"}, chat[1]]


def _prompt_tokens(client, **kwargs) -> int:
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=1,
                                          **kwargs).usage.prompt_tokens


def test_tools_the_template_ignores_are_logged_once_then_described_on_request(live_server, client, monkeypatch):
    state = live_server.app.state.jvllm
    monkeypatch.setattr(state, "template_shows_tools", None)  # as on a fresh server
    plain = _prompt_tokens(client)
    with LogRecords(logging.WARNING) as records:
        for _ in range(2):
            assert _prompt_tokens(client, tools=[WEATHER], tool_choice="required") == plain  # the model never saw it
    warnings = [r.getMessage() for r in records if "ignores `tools`" in r.getMessage()]
    assert len(warnings) == 1 and "--tools-in-system-prompt" in warnings[0]

    monkeypatch.setattr(state.settings, "tools_in_system_prompt", True)
    monkeypatch.setattr(state.settings, "enable_auto_tool_choice", True)
    monkeypatch.setattr(state.settings, "tool_call_parser", "hermes")
    described = with_tools_described(ASK, tools_description([WEATHER], "hermes"))
    expected = len(live_server.engine.tokenize(live_server.engine.apply_chat_template(
        described, add_generation_prompt=True), add_special_tokens=False))
    assert _prompt_tokens(client, tools=[WEATHER], tool_choice="auto") == expected > plain
