"""SageMaker's hosting routes, as vLLM's server has them: GET and POST /ping (the health check) and POST
/invocations, one route for chat, completion and embedding requests, told apart by their fields. Unlike vLLM's,
/invocations asks for the API key when the server has one, as every inference route does."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import pydantic
from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from server.auth import check_api_key
from server.chat import create_chat_completion
from server.completions import create_completion
from server.embeddings import create_embedding
from server.api_errors import bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from server.responses import ErrorResponse
from server.state import engine_health, state_of

Guard = Callable[[Request, Awaitable[Response]], Awaitable[Response]]
# the field that tells each kind of body apart, checked in this order, with its request model and handler
INVOCATION_KINDS: tuple[tuple[str, type[pydantic.BaseModel], Callable[..., Awaitable[Response]]], ...] = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("input", EmbeddingRequest, create_embedding),
)
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 413, 500, 503)}


def sagemaker_routes(guarded: Guard) -> APIRouter:
    router = APIRouter()

    @router.get("/ping", response_class=Response, responses={200: {"description": "the engine is running"}})
    @router.post("/ping", response_class=Response, responses={200: {"description": "the engine is running"}})
    async def ping(request: Request) -> Response:
        return engine_health(request)

    @router.post("/invocations", dependencies=[Depends(check_api_key)], responses=_ERRORS)
    async def invocations(request: Request) -> Response:
        try:
            data = await request.json()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise bad_request("the body is not JSON (or nests too deeply)", None) from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object", None)
        for field, model, handler in INVOCATION_KINDS:
            if field in data:
                try:
                    body = model.model_validate(data)
                except pydantic.ValidationError as error:
                    raise RequestValidationError(error.errors()) from None
                return await guarded(request, handler(body, request, state_of(request)))
        raise bad_request("an /invocations body holds messages (a chat), prompt (a completion) or input "
                          "(embeddings)", None)

    return router
