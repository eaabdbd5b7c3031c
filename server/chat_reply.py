"""One chat choice's text as OpenAI's message: reasoning, content and tool calls, whole or as stream deltas."""
from __future__ import annotations

from server.reasoning import ReasoningStream, partial_tag, split_reasoning
from server.responses import ChatMessageOut, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from server.tool_parsers import ParsedReply
from server.tools import ToolPlan, new_call_id, tool_call_deltas, tool_calls_out


def whole_reply(text: str, plan: ToolPlan, reasoning_parser: str | None, finish_reason: str | None,
                echo: str = "") -> tuple[ChatMessageOut, str | None]:
    """The finished choice's message and its finish reason ("tool_calls" when the model called tools)."""
    reasoning = None
    if reasoning_parser is not None:
        split = split_reasoning(reasoning_parser, text)
        reasoning, text = split.reasoning, split.content or ""
    reply = plan.parse(text) if plan.calls_tools else ParsedReply(text, [])
    content = reply.content if reply.calls else text
    message = ChatMessageOut(content=echo + (content or "") if content is not None or echo else None,
                             reasoning_content=reasoning, tool_calls=tool_calls_out(reply.calls))
    return message, plan.finish_reason(bool(reply.calls), finish_reason)


class StreamedReply:
    """Feeds one choice's new text; -> the delta to send (None: nothing yet). Content streams as it comes;
    calls of `required` and `auto` are sent whole once the reply ends, those of a named choice as argument text
    while it is written. Reassembled, the deltas give whole_reply's message."""

    def __init__(self, plan: ToolPlan, reasoning_parser: str | None):
        self.plan = plan
        self._reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self._text = ""  # content text received (after any reasoning)
        self._sent = 0  # characters of _text sent, as content or as a named call's arguments
        self.made_calls = False

    def feed(self, piece: str, final: bool) -> DeltaMessage | None:
        reasoning, text = self._reasoning.feed(piece, final) if self._reasoning else ("", piece)
        self._text += text
        delta = DeltaMessage()
        if reasoning:
            delta.reasoning_content = reasoning
        mode = self.plan.mode
        if mode == "named":
            self._named_call(delta, final)
        elif mode in ("required", "auto"):
            self._held_calls(delta, final)
        elif self._sent < len(self._text):
            delta.content = self._text[self._sent:]
            self._sent = len(self._text)
        return delta if delta.model_fields_set else None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.plan.finish_reason(self.made_calls, finish_reason)

    def _named_call(self, delta: DeltaMessage, final: bool) -> None:
        fragment = self._text[self._sent:]
        if not fragment and (self.made_calls or not final):
            return
        call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=fragment))
        if not self.made_calls:
            call.id, call.type, call.function.name = new_call_id(), "function", self.plan.named
            self.made_calls = True
        delta.tool_calls = [call]
        self._sent = len(self._text)

    def _held_calls(self, delta: DeltaMessage, final: bool) -> None:
        """Content before where calls may start goes out now; the rest waits for the end of the reply."""
        if not final:
            start = self.plan.parser.start if self.plan.mode == "auto" else ""
            upto = _safe_end(self._text, start) if start else self._sent
            if upto > self._sent and self._text[:upto].strip():
                delta.content = self._text[self._sent:upto]
                self._sent = upto
            return
        reply = self.plan.parse(self._text)
        if not reply.calls:
            if self._sent < len(self._text):
                delta.content = self._text[self._sent:]
                self._sent = len(self._text)
            return
        head = reply.content or ""
        if len(head) > self._sent:
            delta.content = head[self._sent:]
        delta.tool_calls = tool_call_deltas(reply.calls)
        self.made_calls = True
        self._sent = len(self._text)


def _safe_end(text: str, start: str) -> int:
    """Where content must stop for now: before `start` if it appeared, else before a partial `start` at the end."""
    found = text.find(start)
    return found if found >= 0 else len(text) - partial_tag(text, start)
