"""Request bodies of the OpenAI-compatible routes (OpenAI's fields plus vLLM's sampling extras)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

TokenIds = list[int]
# vLLM's bounds for `seed`: a signed 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class OpenAIModel(BaseModel):
    # Unknown fields are kept (and logged) rather than refused: clients of newer API versions still work.
    # Strict types, as OpenAI's API: "2" is not an integer and 1.5 is not a token id.
    model_config = ConfigDict(extra="allow", strict=True)


def invalid_text_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (value or key) in parsed JSON that is not valid UTF-8 text (a lone
    surrogate from a `\\ud800` escape), or None when every string is valid."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and invalid_text_path(key, where) is not None:
                return path or "body"
            found = invalid_text_path(item, where)
            if found is not None:
                return found
    elif isinstance(value, list) and value and not isinstance(value[0], (int, float)):  # not a token id list
        for index, item in enumerate(value):
            found = invalid_text_path(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


class RequestBody(OpenAIModel):
    """A route's whole JSON body: strings in it must be valid UTF-8 (lone surrogates are refused)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_invalid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError("invalid_text", "{path}: the text is not valid UTF-8 (it contains a lone "
                                                      "surrogate such as \\ud800)", {"path": path})
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="a Lark or GBNF (EBNF) grammar")
    json_object: bool | None = None


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """Fields shared by completions and chat; names and defaults follow vLLM's server."""

    model: str | None = None
    n: int = 1
    best_of: int | None = Field(None, description="accepted when equal to n (no beam search)")
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    echo: bool = False
    truncate_prompt_tokens: int | None = Field(None, description="keep the prompt's last k tokens; -1: as many as "
                                                                 "leave room for max_tokens")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: int = Field(0, ge=SEED_MIN, le=SEED_MAX,
                          description="lower runs first; other than 0 needs --scheduling-policy priority")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="top logprobs per generated token (0..max_logprobs)")
    add_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str = Field(description="a data: URL, a file: URL under --allowed-local-media-path, or http(s) from a "
                                 "public address (or a host in --allowed-media-domains)")
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object in a string")


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="with tools, defaults to auto (which needs --enable-auto-tool-choice and "
                          "--tool-call-parser)")
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids


class TokenizeRequest(RequestBody):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings: OpenAI's fields plus vLLM's truncate_prompt_tokens."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, description="keep only the last k tokens of each input (-1: the model's limit); without it an "
                          "input over the limit is refused")
    normalize: bool | None = Field(None, description="scale each embedding to unit length (true) or return the "
                                                     "pooled vector as it is (false); default: as the model does")
    add_special_tokens: bool = True
