"""A chat run's reply as an Anthropic message: whole, or as Anthropic's stream of content-block events."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from pydantic import BaseModel

from jvllm.engine.request_stream import RequestStream
from jvllm.outputs import RequestOutput
from server.anthropic_protocol import (AnthropicMessage, AnthropicUsage, ContentBlockDeltaEvent, ContentBlockStartEvent,
                                       ContentBlockStopEvent, ContentOut, InputJsonDelta, MessageDelta,
                                       MessageDeltaEvent, MessageDeltaUsage, MessageStartEvent, MessageStopEvent,
                                       PingEvent, StopReason, TextDelta, TextOut, ThinkingDelta, ThinkingOut,
                                       ToolUseOut)
from server.chat import ChatRun
from server.chat_reply import StreamedReply
from server.api_errors import APIError
from server.errors import anthropic_error_body
from server.responses import ChatCompletionResponse, DeltaMessage
from server.streaming import check_not_failed


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    """A call's id in Anthropic's form (`toolu_...`): the chat route's id, renamed."""
    return "toolu_" + call_id.removeprefix("chatcmpl-tool-")


def stop_reason(finish_reason: str | None, matched: int | str | None,
                made_calls: bool) -> tuple[StopReason, str | None]:
    """-> (stop_reason, stop_sequence): max_tokens for a cut reply, tool_use when it called tools, stop_sequence
    with the one that ended it, else end_turn (an end-of-turn or stop token)."""
    if finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    """The call's input object; arguments that are not one (a call cut by max_tokens) give {}."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def whole_message(response: ChatCompletionResponse) -> AnthropicMessage:
    """The chat route's response (one choice) as Anthropic's: thinking, text, then the tool_use blocks."""
    choice = response.choices[0]
    message = choice.message
    content: list[ContentOut] = []
    if message.reasoning_content:
        content.append(ThinkingOut(thinking=message.reasoning_content))
    if message.content:
        content.append(TextOut(text=message.content))
    content += [ToolUseOut(id=tool_use_id(call.id), name=call.function.name, input=_tool_input(call.function.arguments))
                for call in message.tool_calls]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(message.tool_calls))
    usage = AnthropicUsage(input_tokens=response.usage.prompt_tokens, output_tokens=response.usage.completion_tokens)
    return AnthropicMessage(id=message_id(response.id), model=response.model, content=content, stop_reason=reason,
                            stop_sequence=sequence, usage=usage)


def event(payload: BaseModel) -> str:
    """One server-sent event: `event: <type>`, then the payload as JSON."""
    return f"event: {payload.type}\ndata: {payload.model_dump_json()}\n\n"


def error_events(error: APIError) -> list[str]:
    """An error after the stream began: one `error` event, the stream's last."""
    return [f"event: error\ndata: {json.dumps(anthropic_error_body(error.status, error.message))}\n\n"]


class MessageEvents:
    """Turns one chat run's stream into Anthropic's events: message_start, then each content block (thinking, text,
    tool_use) started, its deltas, and stopped before the next one starts, then message_delta and message_stop."""

    def __init__(self, chat: ChatRun):
        self.chat = chat
        self.blocks = 0  # content blocks started
        self._open: str | None = None  # the type of the block open now

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        chat = self.chat
        yield event(MessageStartEvent(message=AnthropicMessage(
            id=message_id(chat.id), model=chat.model, content=[],
            usage=AnthropicUsage(input_tokens=chat.num_prompt, output_tokens=0))))
        yield event(PingEvent())
        reply = StreamedReply(chat.tools, chat.state.settings.reasoning_parser)
        for item in self._delta(reply.start()):
            yield item
        sent, latest = 0, None
        async for output in stream:
            latest = check_not_failed(output)
            out = latest.outputs[0]
            finished = out.finish_reason is not None
            for item in self._delta(reply.feed(out.text[sent:], finished, out.finish_reason == "length")):
                yield item
            sent = len(out.text)
        for item in self._close():
            yield item
        for item in self._end(latest, reply.made_calls):
            yield item

    def _end(self, latest: RequestOutput | None, made_calls: bool) -> list[str]:
        assert latest is not None, "the request's stream ended without an output"
        out = latest.outputs[0]
        self.chat.state.log_request(self.chat.id, "finished", out.text)
        reason, sequence = stop_reason(out.finish_reason, out.stop_reason, made_calls)
        return [event(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                        usage=MessageDeltaUsage(output_tokens=len(out.token_ids)))),
                event(MessageStopEvent())]

    def _delta(self, delta: DeltaMessage | None) -> list[str]:
        if delta is None:
            return []
        events: list[str] = []
        if delta.reasoning_content:
            if self._open != "thinking":
                events += self._start(ThinkingOut(thinking=""))
            events.append(self._piece(ThinkingDelta(thinking=delta.reasoning_content)))
        if delta.content:
            if self._open != "text":
                events += self._start(TextOut(text=""))
            events.append(self._piece(TextDelta(text=delta.content)))
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: its id and name
                events += self._start(ToolUseOut(id=tool_use_id(call.id), name=call.function.name or "", input={}))
            if call.function.arguments and self._open == "tool_use":
                events.append(self._piece(InputJsonDelta(partial_json=call.function.arguments)))
        return events

    def _piece(self, delta: TextDelta | InputJsonDelta | ThinkingDelta) -> str:
        return event(ContentBlockDeltaEvent(index=self.blocks - 1, delta=delta))

    def _start(self, block: ContentOut) -> list[str]:
        events = self._close()
        events.append(event(ContentBlockStartEvent(index=self.blocks, content_block=block)))
        self.blocks, self._open = self.blocks + 1, block.type
        return events

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event(ContentBlockStopEvent(index=self.blocks - 1))]
