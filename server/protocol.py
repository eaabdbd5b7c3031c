"""Request bodies of the OpenAI-compatible routes (OpenAI's fields plus vLLM's sampling extras)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]


class OpenAIModel(BaseModel):
    # Unknown fields are kept (and logged) rather than refused: clients of newer API versions still work.
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class SamplingFields(OpenAIModel):
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
    seed: int | None = None
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
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    echo: bool = False


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="top logprobs per generated token (0..max_logprobs)")
    add_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings: OpenAI's fields plus vLLM's truncate_prompt_tokens."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, description="keep only the last k tokens of each input (-1: the model's limit); without it an "
                          "input over the limit is refused")
    add_special_tokens: bool = True
