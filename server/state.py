"""Everything a route handler needs, kept on `app.state.jvllm`."""
from __future__ import annotations

import dataclasses
import logging
import time

from fastapi import Request
from fastapi.responses import Response

from jvllm.engine.async_engine import AsyncEngine
from server.blocking import BlockingWork
from server.api_errors import APIError
from server.limits import AdmissionLimits
from server.metrics import ServerMetrics
from server.response_store import ResponseStore
from server.settings import ServerSettings
from server.tokens import TokenText

request_logger = logging.getLogger("jvllm.requests")


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    names: TokenText
    limits: AdmissionLimits
    blocking: BlockingWork
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))
    template_shows_tools: bool | None = None  # whether the chat template renders `tools` (found on first use)
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # for previous_response_id

    def log_request(self, request_id: str, what: str, content: object, *context: object) -> None:
        """`content` (prompts, outputs: its repr, cut at --max-log-len characters) and `context` (e.g. the sampling
        parameters) are logged only with --enable-log-requests; ids always at debug."""
        if self.settings.enable_log_requests:
            text = repr(content)
            limit = self.settings.max_log_len
            if limit and len(text) > limit:
                text = f"{text[:limit]}... ({len(text) - limit} more characters)"
            request_logger.info("%s %s: %s", request_id, what, " ".join([text, *map(str, context)]))
        else:
            request_logger.debug("%s %s", request_id, what)

    async def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of request text, computed on the blocking-work pool."""
        return await self.blocking.run(self.engine.tokenize, text, add_special_tokens=add_special_tokens)


def state_of(request: Request) -> ServerState:
    return request.app.state.jvllm


def engine_health(request: Request) -> Response:
    """200 while the engine runs, else 503: what /health (and SageMaker's /ping) answer."""
    if not state_of(request).engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_dead")
    return Response(status_code=200)
