"""Tool calling: what `tools` and `tool_choice` ask for, the grammar that forces calls, and where calls sit."""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from jvllm.sampling_params import StructuredOutputsParams
from server.api_errors import bad_request
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.tool_parsers import ToolParser
from server.tool_stream import Layout

ANY_ARGUMENTS = {"type": "object"}


@dataclasses.dataclass
class ToolPlan:
    """How one chat request uses its tools: mode is "none", "auto", "required" or "named".

    `required` constrains the reply to a JSON list of calls, `[{"name": ..., "parameters": {...}}, ...]`, each
    `parameters` following its function's schema; a named choice constrains it to that function's arguments;
    `auto` lets the model write calls in its own format, read by the server's --tool-call-parser."""

    mode: str
    tools: list[dict] = dataclasses.field(default_factory=list)  # as the chat template takes them
    named: str | None = None
    parser: ToolParser | None = None

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def constraint(self, parallel: bool) -> StructuredOutputsParams | None:
        """The grammar that forces valid calls (required, named), or None."""
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or ANY_ARGUMENTS
                   for tool in self.tools}
        if self.mode == "named":
            return StructuredOutputsParams(json=schemas[self.named])
        if self.mode != "required":
            return None
        # Each function's schema moves under the list schema's $defs, its own local $refs re-rooted there.
        definitions = {f"tool{i}": rerooted(schema, f"#/$defs/tool{i}") for i, schema in enumerate(schemas.values())}
        one_call = [{"type": "object",
                     "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{key}"}},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for name, key in zip(schemas, definitions)]
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}, "$defs": definitions}
        if not parallel:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls)

    def layout(self) -> Layout | None:
        """Where calls sit in the reply: `required`'s JSON list (named by the grammar's names), the auto parser's
        layout; None for a named choice (the whole reply is its arguments) and for none."""
        if self.mode == "required":
            names = tuple(tool["function"]["name"] for tool in self.tools)
            return Layout(lists=True, argument_keys=("parameters",), prose=False, names=names)
        if self.mode == "auto" and self.parser is not None:
            return self.parser.layout
        return None

    def finish_reason(self, made_calls: bool, finish_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a forced named call "stops"."""
        if made_calls and self.mode in ("auto", "required") and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def rerooted(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local $refs ("#", "#/$defs/X", any "#/..." pointer) point into it once it sits at
    the JSON pointer `base` of a larger schema."""
    copy = json.loads(json.dumps(schema))
    stack = [copy]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                node["$ref"] = base + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return copy


def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    """The request's tool plan; 400 for a choice naming an unknown tool, or auto without the server flags."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the tool {choice.function.name!r}, which is not in tools "
                              f"({', '.join(names)})", "tool_choice")
        return ToolPlan("named", tools, named=choice.function.name)
    mode = choice or "auto"
    if mode == "auto" and parser is None:
        raise bad_request('"auto" tool choice needs the server to run with --enable-auto-tool-choice and '
                          "--tool-call-parser", "tool_choice")
    return ToolPlan(mode, tools, parser=parser if mode == "auto" else None)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects: chat templates iterate over them (as vLLM passes
    them); arguments that are not a JSON object stay text."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call["function"]
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass
    return messages
