"""A streamed Responses API response: the chat reply's deltas as typed, numbered server-sent events."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from jvllm.engine.request_stream import RequestStream
from server.chat import ChatRun
from server.chat_reply import StreamedReply
from server.api_errors import APIError
from server.responses import DeltaMessage, DeltaToolCall
from server.responses_api_protocol import (OutputFunctionCall, OutputItem, OutputMessage, OutputReasoning, OutputText,
                                           ReasoningText, ResponseObject)
from server.responses_output import ResponseShell, new_item_id
from server.streaming import check_not_failed


class EventWriter:
    """`event: <type>` and `data: <json>` framing; every event carries its type and the next sequence number."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence,
                   **{key: value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value
                      for key, value in fields.items()}}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def error(self, error: APIError) -> list[str]:
        """An error once the stream began: one `error` event, the stream's last."""
        return [self("error", code=error.code, message=error.message, param=error.param)]


class ResponseEvents:
    """Turns one chat run's stream into the Responses API's events: each output item (reasoning, message, function
    call) is added, its text streamed, and done before the next one opens; the last event holds the response."""

    def __init__(self, shell: ResponseShell, chat: ChatRun, writer: EventWriter,
                 finished: Callable[[ResponseObject], None]):
        self.shell, self.chat, self.event, self.finished = shell, chat, writer, finished
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        progress = self.shell.build([], done=False)
        yield self.event("response.created", response=progress)
        yield self.event("response.in_progress", response=progress)
        reply = StreamedReply(self.chat.tools, self.chat.state.settings.reasoning_parser)
        for event in self._delta(reply.start()):
            yield event
        sent, latest, text = 0, None, ""
        async for output in stream:
            latest = check_not_failed(output)
            out = output.outputs[0]
            finished = out.finish_reason is not None
            for event in self._delta(reply.feed(out.text[sent:], finished, out.finish_reason == "length")):
                yield event
            sent, text = len(out.text), out.text
        cut = latest is not None and latest.outputs[0].finish_reason == "length"
        if not self.items and self._open is None and not text and self.chat.tools.mode not in ("required", "named"):
            for event in self._content(""):  # a reply with nothing still has its (empty) message
                yield event
        for event in self._close("incomplete" if cut else "completed"):
            yield event
        response = self.shell.build(self.items, self.chat.usage(latest), cut=cut)
        self.chat.state.log_request(self.chat.id, "finished", text)
        self.finished(response)
        yield self.event("response.incomplete" if cut else "response.completed", response=response)

    def _delta(self, delta: DeltaMessage | None) -> list[str]:
        if delta is None:
            return []
        events = self._reasoning(delta.reasoning_content) if delta.reasoning_content else []
        if delta.content:
            events += self._content(delta.content)
        for call in delta.tool_calls or []:
            events += self._call(call)
        return events

    def _place(self, item: OutputItem) -> tuple[list[str], int]:
        """Closes the open item and opens `item` -> the events and its output index."""
        events = self._close()
        self._open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
        return events, len(self.items)

    def _reasoning(self, text: str) -> list[str]:
        events, index = [], len(self.items)
        if not isinstance(self._open, OutputReasoning):
            events, index = self._place(OutputReasoning(id=new_item_id("rs"), content=[], status="in_progress"))
            events.append(self.event("response.content_part.added", item_id=self._open.id, output_index=index,
                                     content_index=0, part=ReasoningText(text="")))
            self._open.content.append(ReasoningText(text=""))
        self._open.content[0].text += text
        events.append(self.event("response.reasoning_text.delta", item_id=self._open.id, output_index=index,
                                 content_index=0, delta=text))
        return events

    def _content(self, text: str) -> list[str]:
        events, index = [], len(self.items)
        if not isinstance(self._open, OutputMessage):
            events, index = self._place(OutputMessage(id=new_item_id("msg"), status="in_progress", content=[]))
            events.append(self.event("response.content_part.added", item_id=self._open.id, output_index=index,
                                     content_index=0, part=OutputText(text="")))
            self._open.content.append(OutputText(text=""))
        self._open.content[0].text += text
        if text:
            events.append(self.event("response.output_text.delta", item_id=self._open.id, output_index=index,
                                     content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call: DeltaToolCall) -> list[str]:
        events, index = [], len(self.items)
        if call.id is not None:  # a call's first delta: its id and name
            events, index = self._place(OutputFunctionCall(id=new_item_id("fc"), call_id=call.id,
                                                           name=call.function.name or "", arguments="",
                                                           status="in_progress"))
        if isinstance(self._open, OutputFunctionCall) and call.function.arguments:
            self._open.arguments += call.function.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self._open.id,
                                     output_index=index, delta=call.function.arguments))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        """The open item's done events; `status`: incomplete for the last item of a cut reply."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = len(self.items), []
        item.status = status
        self.items.append(item)
        if isinstance(item, OutputFunctionCall):
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     name=item.name, arguments=item.arguments))
        else:
            part = item.content[0]
            kind = "reasoning_text" if isinstance(item, OutputReasoning) else "output_text"
            extra = {} if isinstance(item, OutputReasoning) else {"logprobs": []}
            events.append(self.event(f"response.{kind}.done", item_id=item.id, output_index=index, content_index=0,
                                     text=part.text, **extra))
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events
