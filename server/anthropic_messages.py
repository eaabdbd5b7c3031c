"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, run as chat completions."""
from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.anthropic_protocol import (AnthropicErrorResponse, AnthropicMessage, CountTokensRequest,
                                       CountTokensResponse, MessagesRequest, MessageStreamEvent)
from server.anthropic_reply import MessageEvents, error_events, whole_message
from server.anthropic_request import chat_request
from server.auth import check_anthropic_api_key
from server.chat import chat_prompt, final_output, start_chat
from server.openapi_streams import streamed
from server.sampling import check_model, warn_unknown_fields
from server.state import ServerState, state_of
from server.streaming import sse_response
from server.tools import plan_tools

Guard = Callable[[Request, Awaitable[Response]], Awaitable[Response]]
_ERRORS = {code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 413, 500, 503)}


async def create_message(body: MessagesRequest, request: Request, state: ServerState) -> Response:
    warn_unknown_fields(body, "/v1/messages")
    chat, stream = await start_chat(chat_request(body), state)
    if body.stream:
        return sse_response(MessageEvents(chat).events(stream), [stream], on_error=error_events,
                            keep_alive_s=state.settings.sse_keep_alive_interval)
    final = await final_output(request, stream)
    state.log_request(chat.id, "finished", final.outputs[0].text)
    return JSONResponse(whole_message(chat.response(final)).model_dump())


async def count_tokens(body: CountTokensRequest, state: ServerState) -> Response:
    """The prompt's tokens as /v1/messages would run it (its tools and images included)."""
    warn_unknown_fields(body, "/v1/messages/count_tokens")
    chat = chat_request(body)
    check_model(chat.model, state.settings)
    state.limits.check_tools(len(chat.tools or ()))
    _, ids, _ = await chat_prompt(chat, state, plan_tools(chat, state.settings.auto_tool_parser()))
    return JSONResponse(CountTokensResponse(input_tokens=len(ids)).model_dump())


def anthropic_routes(guarded: Guard) -> APIRouter:
    """The routes, behind the API key (`x-api-key` or a bearer token); `guarded` turns a handler's errors into
    responses (Anthropic's error shape on these paths)."""
    router = APIRouter(dependencies=[Depends(check_anthropic_api_key)])

    @router.post("/v1/messages", responses={200: {"model": AnthropicMessage}, **_ERRORS},
                 openapi_extra=streamed(MessageStreamEvent))
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await guarded(request, create_message(body, request, state_of(request)))

    @router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ERRORS)
    async def messages_count_tokens(body: CountTokensRequest, request: Request) -> Response:
        return await guarded(request, count_tokens(body, state_of(request)))

    return router
