"""What the server was configured with (from `jvllm serve` flags or a test)."""
from __future__ import annotations

import dataclasses

from jvllm.engine.arg_utils import human_int, json_list, option
from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS, ToolParser

# A request-supplied chat template (only with trust_request_chat_template) must render within this time.
REQUEST_TEMPLATE_TIMEOUT_S = 0.5


SERVER_GROUP = "server"
LIMITS_GROUP = "admission limits (a request over one is refused with 400/413 before any work)"
CORS_GROUP = "CORS (as vLLM's flags; values are JSON lists)"
TOOLS_GROUP = "tool calling (as vLLM's flags)"


@dataclasses.dataclass
class ServerSettings:
    """The server's own options: `jvllm serve` makes one flag per field that has help (`option`); the others come
    from the engine's options (its served names, where the weights came from, its reasoning parser)."""

    served_model_names: list[str]  # empty: the engine's model name (run_server fills it in)
    model_root: str | None = None  # where the weights came from, shown by /v1/models
    reasoning_parser: str | None = None  # the engine's: replies' <think> text becomes reasoning_content
    host: str = option("127.0.0.1", "interface to bind (default 127.0.0.1, this machine only; 0.0.0.0 exposes the "
                                    "server to the network)", group=SERVER_GROUP)
    port: int = option(8000, "TCP port (default 8000)", parse=int, group=SERVER_GROUP)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (default: $JVLLM_API_KEY, else no key)",
                                 group=SERVER_GROUP)
    max_waiting_requests: int = option(1024, "queued requests beyond which new ones get 503 + Retry-After "
                                             "(default 1024)", parse=human_int, group=SERVER_GROUP)
    shutdown_timeout: float = option(30.0, "seconds open requests may run after SIGTERM before they are aborted "
                                           "(default 30)", parse=float, group=SERVER_GROUP)
    chat_template: str | None = option(None, "Jinja chat template (file or text) replacing the tokenizer's",
                                       group=SERVER_GROUP)
    max_logprobs: int = option(20, "largest logprobs/top_logprobs allowed (20)", parse=int, group=SERVER_GROUP)
    enable_log_requests: bool = option(False, "log prompts, parameters and outputs (off by default: they may be "
                                              "private)", group=SERVER_GROUP)
    disable_access_log: bool = option(False, "no per-request access log lines", group=SERVER_GROUP)
    enable_prompt_tokens_details: bool = option(False, "report usage.prompt_tokens_details.cached_tokens (prompt "
                                                       "tokens read from the prefix cache) on completions and chat, "
                                                       "as vLLM's flag does", group=SERVER_GROUP)
    log_level: str = option("info", "server log level (default info)", choices=["debug", "info", "warning", "error"],
                            group=SERVER_GROUP)
    # admission limits (None: derived from the engine, see server.limits)
    max_n: int | None = option(None, "largest n (completions per prompt) a request may ask (default and maximum: "
                                     "--max-num-seqs)", parse=human_int, group=LIMITS_GROUP)
    max_prompt_chars: int | None = option(None, "longest prompt text in characters, checked before tokenizing "
                                                "(default: max-model-len x the longest token's characters, so only "
                                                "prompts that cannot fit are refused)", parse=human_int,
                                          group=LIMITS_GROUP)
    max_request_body_bytes: int = option(DEFAULT_MAX_REQUEST_BODY_BYTES, "largest request body; larger ones get 413 "
                                                                         "(default 32m)", parse=human_int,
                                         group=LIMITS_GROUP)
    trust_request_chat_template: bool = option(False, "accept a `chat_template` in requests (refused by default: a "
                                                      "template is code the server runs; even trusted ones get a "
                                                      "time bound)", group=LIMITS_GROUP)
    disable_web_ui: bool = option(False, "no chat page at / (the API routes are the same either way)",
                                  group=SERVER_GROUP)
    allowed_origins: list[str] = option(["*"], 'allowed origins (default ["*"])', parse=json_list, group=CORS_GROUP)
    allowed_methods: list[str] = option(["*"], 'allowed methods (default ["*"])', parse=json_list, group=CORS_GROUP)
    allowed_headers: list[str] = option(["*"], 'allowed headers (default ["*"])', parse=json_list, group=CORS_GROUP)
    allow_credentials: bool = option(False, "allow credentials (cookies, auth headers)", group=CORS_GROUP)
    enable_auto_tool_choice: bool = option(False, "let the model decide when to call tools (tool_choice \"auto\", "
                                                  "the default when a request has tools); needs --tool-call-parser",
                                           group=TOOLS_GROUP)
    tool_call_parser: str | None = option(None, "the format the model writes tool calls in: hermes "
                                                "(<tool_call>{...}</tool_call>), llama3_json ({\"name\": ..., "
                                                "\"parameters\": ...}), mistral ([TOOL_CALLS][...])",
                                          choices=sorted(TOOL_PARSERS), group=TOOLS_GROUP)
    tools_in_system_prompt: bool = option(False, "when the chat template does not render `tools` (the log says so "
                                                 "on the first request with tools), describe them in a system "
                                                 "message, with the --tool-call-parser's call format", group=TOOLS_GROUP)

    def __post_init__(self) -> None:
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
