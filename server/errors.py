"""OpenAI-style (and, on the Anthropic routes, Anthropic-style) error bodies and the exception handlers that
produce them (never a traceback)."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jvllm.engine.status import EngineDeadError, EngineShutDownError, EngineStepError, QueueFullError
from jvllm.pooling.async_batcher import EmbedderClosedError
from server.api_errors import APIError, ClientGone

logger = logging.getLogger("jvllm.server")

RETRY_AFTER_SECONDS = 1
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "server_error"}
# The Anthropic Messages API routes answer errors in Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error" if status < 500
                                                                  else "server_error"),
                      "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body a route at `path` answers: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def route_path(scope: dict) -> str:
    """The request's path as the routes see it (a proxy's root_path taken off)."""
    return scope["path"].removeprefix(scope.get("root_path") or "")


def to_api_error(error: BaseException) -> APIError:
    """Map an exception from request handling to what the client is told."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ClientGone):
        return APIError(499, "the client closed the request")
    if isinstance(error, QueueFullError):
        return APIError(503, str(error), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineShutDownError):
        return APIError(503, "the server is shutting down; retry on another replica or later", code="shutting_down")
    if isinstance(error, (EngineDeadError, EmbedderClosedError)):
        return APIError(503, "the engine is not running", code="engine_dead")
    if isinstance(error, EngineStepError):
        return APIError(500, "the engine failed while running this request", code="engine_error")
    if isinstance(error, ValueError):  # the engine's and SamplingParams' validation messages
        return APIError(400, str(error))
    logger.error("internal error", exc_info=error)
    return APIError(500, "internal server error", code="internal_error")


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """`error` as the route at `path` tells it (error_body_for)."""
    return JSONResponse(error_body_for(path, error.status, error.message, error.param, error.code),
                        status_code=error.status, headers=error.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for item in exc.errors():
        loc = [str(x) for x in item.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if item.get("type") == "invalid_text":  # raised for the whole body: the message names the field
            param = param or item.get("ctx", {}).get("path")
            parts.append(str(item.get("msg")))
            continue
        if item.get("type") == "json_invalid":  # loc holds the character position, not a field
            error = item.get("ctx", {}).get("error")
            parts.append(f"the request body is not valid JSON: {error or item.get('msg')} (at character {where})")
            continue
        param = param or (where or None)
        if not where and item.get("type") in ("model_attributes_type", "dict_type"):
            parts.append("the request body must be a JSON object (send Content-Type: application/json)")
            continue
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, route_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param), route_path(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)),
                              route_path(request.scope))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc), route_path(request.scope))
