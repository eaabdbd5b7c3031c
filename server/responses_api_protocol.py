"""Request and response bodies of OpenAI's Responses API (POST /v1/responses), the parts this server serves."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from server.protocol import OpenAIModel, RequestBody


class InputTextPart(OpenAIModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(OpenAIModel):
    """An earlier assistant turn's text, as a client sends it back."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None


class RefusalPart(OpenAIModel):
    type: Literal["refusal"]
    refusal: str


class InputImagePart(OpenAIModel):
    type: Literal["input_image"]
    image_url: str | None = Field(None, description="a data: URL, a file: URL under --allowed-local-media-path, or "
                                                    "http(s); file_id is not supported")
    detail: Literal["auto", "low", "high"] | None = None
    file_id: str | None = None


ContentPart = Annotated[InputTextPart | OutputTextPart | RefusalPart | InputImagePart, Field(discriminator="type")]


class MessageInput(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallInput(OpenAIModel):
    """A call the model made in an earlier turn, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(OpenAIModel):
    """The result of a call: it reaches the model as a tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Annotated[InputTextPart | InputImagePart, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None


class ReasoningInput(OpenAIModel):
    """An earlier turn's reasoning, sent back: accepted, not shown to the model again."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str:
    """Items without a `type` are messages (OpenAI's "easy input message")."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[Annotated[MessageInput, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
                      | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
                      | Annotated[ReasoningInput, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionToolParam(OpenAIModel):
    """A function the model may call (the only kind of tool served: no hosted tools)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """`text.format`: free text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenAIModel):
    """Accepted; reasoning text is split out by the server's --reasoning-parser, whatever the effort asked."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(RequestBody):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="a system message before the conversation")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description="with tools, defaults to auto (which needs --enable-auto-tool-choice and "
                          "--tool-call-parser)")
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    previous_response_id: str | None = Field(None, description="continue a stored response's conversation (kept "
                                                               "in memory, the most recent ones only)")
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(None, description="accepted; nothing extra is included")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="accepted; a prompt over the context "
                                                                              "is refused (400)")


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response: its output items, status, usage, and the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[FunctionToolParam] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    text: TextConfig
    temperature: float
    top_p: float
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response (`event:` names its type too); the other fields depend on the type:
    `response` (created, in_progress, completed, incomplete), `item` and `output_index` (output_item.*), `delta`
    (*.delta), `text` / `arguments` (*.done), `part` (content_part.*), `message` and `code` (error)."""

    type: str
    sequence_number: int
