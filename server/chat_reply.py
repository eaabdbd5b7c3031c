"""One chat choice's text as OpenAI's message: reasoning, content and tool calls, whole or as stream deltas."""
from __future__ import annotations

from server.reasoning import ReasoningStream, split_reasoning
from server.responses import (ChatMessageOut, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCallOut,
                              ToolCallOut)
from server.tool_stream import CallPiece, CallStream, Pieces
from server.tools import ToolPlan, new_call_id


class ReplyReader:
    """A choice's content text (after any reasoning) -> Pieces, as it arrives: plain content without tools; for a
    named choice one call, named before any text, whose arguments are the text; otherwise the plan's layout."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        layout = plan.layout()
        self._stream = CallStream(layout) if layout is not None else None
        self._started = False

    def start(self) -> Pieces:
        """What is known before any text: the header of a call the choice forces."""
        self._started = True
        if self._stream is not None:
            return self._stream.start()
        pieces = Pieces()
        if self.plan.mode == "named":
            pieces.calls.append(CallPiece(0, name=self.plan.named))
        return pieces

    def feed(self, text: str, final: bool, cut: bool = False) -> Pieces:
        pieces = Pieces() if self._started else self.start()
        if self._stream is not None:
            pieces.merge(self._stream.feed(text, final, cut))
        elif self.plan.mode == "named":
            if text:
                pieces.call(0).arguments += text
        else:
            pieces.content += text
        return pieces


def whole_reply(text: str, plan: ToolPlan, reasoning_parser: str | None, finish_reason: str | None,
                echo: str = "") -> tuple[ChatMessageOut, str | None]:
    """The finished choice's message and its finish reason ("tool_calls" when the model called tools; a reply cut
    by max_tokens keeps "length", its last call partial)."""
    reasoning = None
    if reasoning_parser is not None:
        split = split_reasoning(reasoning_parser, text)
        reasoning, text = split.reasoning, split.content or ""
    pieces = ReplyReader(plan).feed(text, final=True, cut=finish_reason == "length")
    calls: dict[int, ToolCallOut] = {}
    for piece in pieces.calls:
        call = calls.setdefault(piece.index, ToolCallOut(id=new_call_id(), function=FunctionCallOut(
            name=piece.name or "", arguments="")))
        call.function.arguments += piece.arguments
    content: str | None = pieces.content
    if not content and (calls or text or plan.mode in ("required", "named")):
        content = None  # no text, or all of it was calls
    message = ChatMessageOut(content=echo + (content or "") if content is not None or echo else None,
                             reasoning_content=reasoning, tool_calls=[calls[index] for index in sorted(calls)])
    return message, plan.finish_reason(bool(calls), finish_reason)


class StreamedReply:
    """Feeds one choice's new text; -> the delta to send (None: nothing yet). Content streams as it comes; a
    call's id and name go out once known, then its argument text as each piece of it is written. Reassembled,
    the deltas give whole_reply's message."""

    def __init__(self, plan: ToolPlan, reasoning_parser: str | None):
        self.plan = plan
        self._reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self._reader = ReplyReader(plan)
        self.made_calls = False

    def start(self) -> DeltaMessage | None:
        """The delta known before any token (a forced call's header), for the stream's first chunk."""
        return self._delta("", self._reader.start())

    def feed(self, piece: str, final: bool, cut: bool = False) -> DeltaMessage | None:
        """`cut`: the choice ended by max_tokens."""
        reasoning, text = self._reasoning.feed(piece, final) if self._reasoning else ("", piece)
        return self._delta(reasoning, self._reader.feed(text, final, cut))

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.plan.finish_reason(self.made_calls, finish_reason)

    def _delta(self, reasoning: str, pieces: Pieces) -> DeltaMessage | None:
        delta = DeltaMessage()
        if reasoning:
            delta.reasoning_content = reasoning
        if pieces.content:
            delta.content = pieces.content
        if pieces.calls:
            delta.tool_calls = [call for piece in pieces.calls for call in _tool_deltas(piece)]
            self.made_calls = True
        return delta if delta.model_fields_set else None


def one_entry_per_call(delta: DeltaMessage) -> list[DeltaMessage]:
    """A delta -> deltas in which each call appears at most once (a call's header and its first argument text,
    decoded in one step, go out as two chunks, as OpenAI streams them); text and reasoning stay in the first."""
    groups: list[list[DeltaToolCall]] = [[]]
    for call in delta.tool_calls or []:
        if any(earlier.index == call.index for earlier in groups[-1]):
            groups.append([])
        groups[-1].append(call)
    if len(groups) == 1:
        return [delta]
    first = delta.model_copy()
    first.tool_calls = groups[0]
    return [first, *(DeltaMessage(tool_calls=group) for group in groups[1:])]


def _tool_deltas(piece: CallPiece) -> list[DeltaToolCall]:
    """A call's first delta carries its id, type and name with empty arguments (as OpenAI streams it, even when the
    name and argument text were decoded in the same step); every later delta its new argument text."""
    fragment = DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
    if piece.name is None:
        return [fragment]
    header = DeltaToolCall(index=piece.index, id=new_call_id(), type="function",
                           function=DeltaFunctionCall(name=piece.name, arguments=""))
    return [header, fragment] if piece.arguments else [header]
