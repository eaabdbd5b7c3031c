"""Tools for chat templates that ignore them: detecting such a template, and describing tools in a system message."""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from server.state import ServerState

logger = logging.getLogger("jvllm.server")

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_rendering_7f3a",
                                                "description": "a tool no real request names",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_MESSAGES = [{"role": "user", "content": "hello"}]

# How each --tool-call-parser expects a call written; the grammar writes required/named calls itself.
_CALL_FORMATS = {
    "hermes": ('To call a function, write <tool_call>{"name": "<function name>", "arguments": {<arguments as '
               'JSON>}}</tool_call>; one such block per call.'),
    "llama3_json": ('To call a function, reply with nothing but {"name": "<function name>", "parameters": '
                    '{<arguments as JSON>}}; separate several calls with ";".'),
    "mistral": ('To call functions, write [TOOL_CALLS] followed by a JSON list of calls, each {"name": '
                '"<function name>", "arguments": {<arguments as JSON>}}.'),
}


def template_renders_tools(render: Callable[[list[dict], list[dict] | None], str]) -> bool:
    """Whether a chat template shows `tools` to the model: `render(messages, tools)` must differ with a tool."""
    return render(_PROBE_MESSAGES, [_PROBE_TOOL]) != render(_PROBE_MESSAGES, None)


def tools_description(tools: list[dict[str, Any]], parser: str | None) -> str:
    """A system-message text listing the functions (one JSON line each) and, with an auto-choice parser, how to
    write a call in its format."""
    lines = ["You can call these functions when they help answer the user. Each is described by a JSON line:"]
    lines += [json.dumps(tool["function"], ensure_ascii=False) for tool in tools]
    if parser in _CALL_FORMATS:
        lines.append(_CALL_FORMATS[parser])
        lines.append("Otherwise reply in plain text.")
    return "\n".join(lines)


def with_tools_described(messages: list[dict[str, Any]], description: str) -> list[dict[str, Any]]:
    """The conversation with the description at the start of its system message (a new one if it has none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{description}\n\n{first['content'] or ''}".rstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": description}, *messages]


async def template_shows_tools(state: "ServerState") -> bool:
    """Whether the server's chat template renders `tools`, found once (on the blocking-work pool) and kept; when it
    does not, the log says so once."""
    if state.template_shows_tools is None:
        def render(messages: list[dict], tools: list[dict] | None) -> str:
            extra = {"tools": tools} if tools else {}
            return state.engine.apply_chat_template(messages, chat_template=state.settings.chat_template,
                                                    add_generation_prompt=True, **extra)

        try:
            shows = await state.blocking.run(template_renders_tools, render)
        except Exception:  # a template that refuses the probe: leave its tools to it
            shows = True
        state.template_shows_tools = shows
        if not shows:
            logger.warning("the chat template ignores `tools`, so the model does not see them; %s",
                           "they are described in a system message (--tools-in-system-prompt)"
                           if state.settings.tools_in_system_prompt else
                           "--tools-in-system-prompt describes them in a system message instead")
    return state.template_shows_tools
