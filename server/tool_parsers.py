"""Tool-call parsers for tool_choice="auto" (--tool-call-parser): find the calls a model wrote in its own format.

Each parser splits a finished reply into the text before the calls (the message content) and the calls, as
(name, arguments JSON text) pairs. A reply whose calls do not parse is all content, as in vLLM."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any


@dataclasses.dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclasses.dataclass
class ParsedReply:
    content: str | None
    calls: list[ParsedCall]


def _call(item: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = next((item[key] for key in argument_keys if key in item), {})
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """Base: `start` marks where calls begin (streaming holds text back from there)."""

    name = ""
    start = ""

    def parse(self, text: str) -> ParsedReply:
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen)."""

    name = "hermes"
    start = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        head, marker, _ = text.partition(self.start)
        if not marker:
            return ParsedReply(_content(text), [])
        calls = []
        for block in self._BLOCK.findall(text):
            try:
                call = _call(json.loads(block), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedReply(_content(text), [])
            calls.append(call)
        return ParsedReply(_content(head), calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `;`."""

    name = "llama3_json"
    start = "{"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG):].lstrip()
        if not body.startswith("{"):
            return ParsedReply(_content(text), [])
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                item, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedReply(_content(text), [])
            call = _call(item, ("parameters", "arguments"))
            if call is None:
                return ParsedReply(_content(text), [])
            calls.append(call)
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return ParsedReply(_content(text), [])
            position = len(body) - len(rest)
        return ParsedReply(None, calls)


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content (Mistral's tokenizers)."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedReply:
        head, marker, tail = text.partition(self.start)
        if not marker:
            return ParsedReply(_content(text), [])
        try:
            items, _ = json.JSONDecoder().raw_decode(tail.strip())
        except json.JSONDecodeError:
            return ParsedReply(_content(text), [])
        items = items if isinstance(items, list) else [items]
        calls = [_call(item, ("arguments", "parameters")) for item in items]
        if not calls or any(call is None for call in calls):
            return ParsedReply(_content(text), [])
        return ParsedReply(_content(head), calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser
                                             for parser in (HermesParser, Llama3JsonParser, MistralParser)}
