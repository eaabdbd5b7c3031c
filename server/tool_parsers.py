"""Tool-call parsers for tool_choice="auto" (--tool-call-parser): where each model family writes its calls."""
from __future__ import annotations

import dataclasses

from server.tool_stream import CallStream, Layout


@dataclasses.dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text, as OpenAI sends it


@dataclasses.dataclass
class ParsedReply:
    content: str | None
    calls: list[ParsedCall]


def read_reply(layout: Layout, text: str) -> ParsedReply:
    """A finished reply's content (None when empty) and calls, read as a stream reads them."""
    stream = CallStream(layout)
    calls: dict[int, ParsedCall] = {}
    content = ""
    for pieces in (stream.start(), stream.feed(text, final=True)):
        content += pieces.content
        for piece in pieces.calls:
            call = calls.setdefault(piece.index, ParsedCall(piece.name or "", ""))
            call.arguments += piece.arguments
    return ParsedReply(content or None, [calls[index] for index in sorted(calls)])


class ToolParser:
    """Base: a name (the --tool-call-parser value) and a Layout, which server.tool_stream reads as the reply
    arrives: text outside calls is content, each call's name goes out once known, then its arguments (the JSON the
    model wrote) as they are written."""

    name = ""
    layout = Layout()

    def parse(self, text: str) -> ParsedReply:
        return read_reply(self.layout, text)


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen)."""

    name = "hermes"
    layout = Layout(marker="<tool_call>", end_tag="</tool_call>")


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: the reply opens with `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `;`; a reply that opens otherwise is all content."""

    name = "llama3_json"
    layout = Layout(prefix="<|python_tag|>", separator=";")


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content (Mistral's tokenizers)."""

    name = "mistral"
    layout = Layout(marker="[TOOL_CALLS]", lists=True)


TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser
                                             for parser in (HermesParser, Llama3JsonParser, MistralParser)}
