"""What the server was configured with (from `jvllm serve` flags or a test)."""
from __future__ import annotations

import dataclasses

from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS, ToolParser

# A request-supplied chat template (only with trust_request_chat_template) must render within this time.
REQUEST_TEMPLATE_TIMEOUT_S = 0.5


@dataclasses.dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    enable_log_requests: bool = False
    max_logprobs: int = 20
    chat_template: str | None = None  # overrides the tokenizer's template when set
    model_root: str | None = None  # where the weights came from, shown by /v1/models
    # admission limits (None: derived from the engine, see server.limits)
    max_n: int | None = None
    max_prompt_chars: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    trust_request_chat_template: bool = False  # vLLM's flag: a request's own `chat_template` is refused otherwise
    # CORS, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # tool calling and reasoning, as vLLM's --enable-auto-tool-choice / --tool-call-parser / --reasoning-parser
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("the server needs at least one served model name")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; known: "
                             f"{', '.join(REASONING_PARSERS)}")

    def auto_tool_parser(self) -> ToolParser | None:
        """The parser that finds calls in `auto` replies (None: auto tool choice is off)."""
        return TOOL_PARSERS[self.tool_call_parser]() if self.enable_auto_tool_choice else None

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name, as in vLLM)."""
        return self.served_model_names[0]

    @property
    def api_key_bytes(self) -> bytes | None:
        return self.api_key.encode() if self.api_key else None
