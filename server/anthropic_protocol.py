"""Request and response bodies of the Anthropic Messages API routes (/v1/messages, /v1/messages/count_tokens)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, RootModel

from server.protocol import OpenAIModel, RequestBody

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class Base64ImageSource(OpenAIModel):
    type: Literal["base64"]
    media_type: str = Field(description="image/jpeg, image/png, image/gif or image/webp")
    data: str


class URLImageSource(OpenAIModel):
    type: Literal["url"]
    url: str = Field(description="fetched as the chat route fetches an image_url")


class ImageBlock(OpenAIModel):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]


class ToolUseBlock(OpenAIModel):
    """A call an assistant turn made (sent back in the conversation's history)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    """A user turn's answer to a call: rendered as a `tool` message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool = Field(False, description="the result's text is rendered after 'Error: '")


class ThinkingBlock(OpenAIModel):
    """An earlier turn's thinking: accepted in the history and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIModel):
    type: Literal["redacted_thinking"]
    data: str


InputBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                       Field(discriminator="type")]


class InputMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class AnthropicTool(OpenAIModel):
    """A client tool (Anthropic's server tools, which have no input_schema, are not served)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the input object")


class AnthropicToolChoice(OpenAIModel):
    """auto: the model decides (needs --enable-auto-tool-choice); any: some tool; tool: the named one; none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="the tool, for type tool")
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(RequestBody):
    """POST /v1/messages/count_tokens: the prompt part of a messages request."""

    model: str | None = Field(None, description="a served model name; absent: the server's model (as in chat)")
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. A final assistant message is continued (prefilled) rather than answered."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    """The reply's reasoning, as the server's --reasoning-parser splits it off (no signature)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentOut = Annotated[TextOut | ToolUseOut | ThinkingOut, Field(discriminator="type")]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    """The reply of POST /v1/messages (and, with empty content, the message of a stream's message_start)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, request_too_large, "
                                  "api_error or overloaded_error")
    message: str


class AnthropicErrorResponse(BaseModel):
    """An error body, and the `error` event of a stream that fails after it began."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    """A piece of a tool_use block's input JSON, as the model writes it; the pieces concatenate to the input."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | InputJsonDelta | ThinkingDelta, Field(discriminator="type")]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class MessageStreamEvent(RootModel):
    """One event of a streamed /v1/messages reply, sent as `event: <type>` and `data: <this as JSON>`."""

    root: Annotated[Union[MessageStartEvent, PingEvent, ContentBlockStartEvent, ContentBlockDeltaEvent,
                          ContentBlockStopEvent, MessageDeltaEvent, MessageStopEvent, AnthropicErrorResponse],
                    Field(discriminator="type")]
