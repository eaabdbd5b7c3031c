"""What the server was configured with (from `jvllm serve` flags or a test)."""
from __future__ import annotations

import dataclasses
import os
import ssl
from typing import Any

from jvllm.engine.arg_utils import human_int, json_list, json_object, option
from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS, ToolParser

# A request-supplied chat template (only with trust_request_chat_template) must render within this time.
REQUEST_TEMPLATE_TIMEOUT_S = 0.5
# Idle keep-alive connections close after this long: above the idle times common clients keep a connection for
# reuse (httpx, which the openai client uses, 5 s; aiohttp 15 s), so the client always lets go first. With the
# server closing first (uvicorn's and vLLM's 5 s), a request sent as the server closes fails ("Server
# disconnected").
DEFAULT_KEEP_ALIVE_S = 20.0


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
    api_key: str | list[str] | None = option(None, "require 'Authorization: Bearer KEY', one of these keys (default: "
                                                   "$JVLLM_API_KEY, else no key)", nargs="+", metavar="KEY",
                                             group=SERVER_GROUP)
    max_waiting_requests: int = option(1024, "queued requests beyond which new ones get 503 + Retry-After "
                                             "(default 1024)", parse=human_int, group=SERVER_GROUP)
    shutdown_timeout: float = option(30.0, "seconds open requests may run after SIGTERM before they are aborted "
                                           "(default 30)", parse=float, group=SERVER_GROUP)
    timeout_keep_alive: float = option(
        DEFAULT_KEEP_ALIVE_S, "seconds an idle HTTP connection is kept open for the client's next request (default 20: "
                              "longer than common clients keep theirs, so that none sends a request on a connection "
                              "the server is closing)", parse=float, group=SERVER_GROUP)
    ssl_keyfile: str | None = option(None, "TLS private key file: serve HTTPS (with --ssl-certfile)",
                                     group=SERVER_GROUP)
    ssl_certfile: str | None = option(None, "TLS certificate file (with --ssl-keyfile)", group=SERVER_GROUP)
    ssl_ca_certs: str | None = option(None, "CA certificates that clients' certificates are checked against "
                                            "(with --ssl-cert-reqs)", group=SERVER_GROUP)
    ssl_cert_reqs: int = option(0, "whether clients must present a certificate: 0 no (default), 1 optional, "
                                   "2 required (Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)",
                                parse=int, choices=[0, 1, 2], group=SERVER_GROUP)
    root_path: str | None = option(None, "the path prefix a reverse proxy serves the API under (e.g. /llm), for "
                                         "the docs' links", group=SERVER_GROUP)
    sse_keep_alive_interval: float = option(
        0.0, "seconds a stream may go without an event before the server sends an SSE comment (': keep-alive'), so "
             "that a proxy with a read timeout does not close a request waiting in the queue (0, the default: never)",
        parse=float, group=SERVER_GROUP)
    uds: str | None = option(None, "listen on this Unix domain socket instead of --host and --port",
                             group=SERVER_GROUP)
    enable_request_id_headers: bool = option(False, "answer every request with an X-Request-Id header (the "
                                                    "request's own X-Request-Id if it sent one)", group=SERVER_GROUP)
    disable_fastapi_docs: bool = option(False, "no /docs, /redoc or /openapi.json", group=SERVER_GROUP)
    default_chat_template_kwargs: dict[str, Any] | None = option(
        None, "keywords every chat template render gets, under the request's own chat_template_kwargs (JSON, e.g. "
              "'{\"enable_thinking\": false}' for Qwen3)", parse=json_object, metavar="JSON", group=SERVER_GROUP)
    chat_template: str | None = option(None, "Jinja chat template (file or text) replacing the tokenizer's",
                                       group=SERVER_GROUP)
    max_logprobs: int = option(20, "largest logprobs/top_logprobs allowed (20)", parse=int, group=SERVER_GROUP)
    enable_log_requests: bool = option(False, "log prompts, parameters and outputs (off by default: they may be "
                                              "private)", group=SERVER_GROUP)
    max_log_len: int = option(2000, "characters of a prompt or output that --enable-log-requests logs (default "
                                    "2000; 0: all)", parse=human_int, group=SERVER_GROUP)
    disable_access_log: bool = option(False, "no per-request access log lines", group=SERVER_GROUP)
    return_tokens_as_token_ids: bool = option(False, "name logprobs' tokens \"token_id:N\" (so tokens that are not "
                                                     "valid UTF-8 alone stay identifiable), unless a request says "
                                                     "otherwise", group=SERVER_GROUP)
    enable_force_include_usage: bool = option(False, "end every streamed completion and chat reply with a usage "
                                                     "chunk, as if the request had asked (stream_options."
                                                     "include_usage)", group=SERVER_GROUP)
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
        self._check_tls()
        if self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be 0 (everything) or a number of characters, got {self.max_log_len}")
        if not self.sse_keep_alive_interval >= 0:
            raise ValueError(f"--sse-keep-alive-interval must be 0 (off) or a positive number of seconds, got "
                             f"{self.sse_keep_alive_interval}")
        if not self.timeout_keep_alive > 0:
            raise ValueError(f"--timeout-keep-alive must be a positive number of seconds, got {self.timeout_keep_alive}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; known: "
                             f"{', '.join(REASONING_PARSERS)}")

    def _check_tls(self) -> None:
        """HTTPS needs a key and a certificate, both readable files; client certificates need HTTPS."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if self.ssl_keyfile is None and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS (--ssl-keyfile and --ssl-certfile)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file: {path}")
        if self.ssl_keyfile is not None:  # read them now: a bad file is an error before the model loads
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            except (ssl.SSLError, OSError) as error:
                raise ValueError(f"--ssl-certfile / --ssl-keyfile: not a certificate and its private key ({error})")
            try:
                if self.ssl_ca_certs is not None:
                    context.load_verify_locations(self.ssl_ca_certs)
            except (ssl.SSLError, OSError) as error:
                raise ValueError(f"--ssl-ca-certs: not CA certificates ({error})")

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_keyfile is None else "https"

    @property
    def address(self) -> str:
        """Where the server listens, for the log."""
        return f"unix socket {self.uds}" if self.uds else f"{self.scheme}://{self.host}:{self.port}"

    def auto_tool_parser(self) -> ToolParser | None:
        """The parser that finds calls in `auto` replies (None: auto tool choice is off)."""
        return TOOL_PARSERS[self.tool_call_parser]() if self.enable_auto_tool_choice else None

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name, as in vLLM)."""
        return self.served_model_names[0]

    @property
    def api_keys(self) -> tuple[bytes, ...]:
        """The keys a request may present (none: no key needed)."""
        keys = [self.api_key] if isinstance(self.api_key, str) else self.api_key or []
        return tuple(key.encode() for key in keys if key)
