"""A chat reply as a Responses API response: output items, status, usage, and the request's settings echoed."""
from __future__ import annotations

import time
import uuid

from server.protocol import ChatMessage, FunctionCall, ToolCall
from server.responses import ChatMessageOut, UsageInfo
from server.responses_api_protocol import (IncompleteDetails, InputTokensDetails, OutputFunctionCall, OutputItem,
                                           OutputMessage, OutputText, OutputReasoning, ReasoningText, ResponseObject,
                                           ResponsesRequest, ResponseUsage, TextConfig, TextFormat)


def new_item_id(prefix: str) -> str:
    """An output item's id: msg_, fc_ or rs_ and 32 hex digits, as OpenAI's."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShell:
    """One response's identity and echoed settings; builds the response object at any stage."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def build(self, output: list[OutputItem], usage: UsageInfo | None = None, *, done: bool = True,
              cut: bool = False) -> ResponseObject:
        """`done`: generation ended (else in_progress); `cut`: by max_output_tokens (or the context's end)."""
        body = self.body
        status = "in_progress" if not done else "incomplete" if cut else "completed"
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model, output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if done and cut else None,
            usage=_usage(usage) if usage is not None else None, instructions=body.instructions,
            tools=body.tools or [], tool_choice=body.tool_choice or "auto",
            text=body.text or TextConfig(format=TextFormat(type="text")),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id, parallel_tool_calls=body.parallel_tool_calls is not False,
            metadata=body.metadata or {}, store=body.store, reasoning=body.reasoning,
            truncation=body.truncation or "disabled", user=body.user)


def _usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached))


def finish_items(items: list[OutputItem], cut: bool) -> list[OutputItem]:
    """Statuses once generation ended: every item completed, except the last one of a cut reply."""
    for item in items:
        item.status = "completed"
    if cut and items:
        items[-1].status = "incomplete"
    return items


def reply_items(message: ChatMessageOut, cut: bool) -> list[OutputItem]:
    """A whole reply's items: its reasoning, its text (an empty message when the reply has nothing else), then one
    item per function call."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(OutputReasoning(id=new_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)],
                                     status="in_progress"))
    if message.content or (message.content is not None and not items and not message.tool_calls):
        items.append(OutputMessage(id=new_item_id("msg"), status="in_progress",
                                   content=[OutputText(text=message.content)]))
    for call in message.tool_calls:
        items.append(OutputFunctionCall(id=new_item_id("fc"), call_id=call.id, name=call.function.name,
                                        arguments=call.function.arguments, status="in_progress"))
    return finish_items(items, cut)


def assistant_message(items: list[OutputItem]) -> ChatMessage:
    """The reply as the assistant turn a later request continues from (its reasoning left out)."""
    texts = [part.text for item in items if isinstance(item, OutputMessage) for part in item.content]
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
             for item in items if isinstance(item, OutputFunctionCall)]
    return ChatMessage(role="assistant", content="".join(texts) if texts else None, tool_calls=calls or None)
