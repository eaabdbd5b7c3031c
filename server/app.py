"""The FastAPI application: OpenAI-compatible /v1 routes, tokenizer routes, health, version, metrics."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

import jvllm
from jvllm.async_engine import AsyncEngine
from server.auth import check_api_key
from server.chat import create_chat_completion, render_chat
from server.completions import create_completion
from server.embeddings import create_embedding
from server.errors import APIError, ClientGone, bad_request, error_response, install_error_handlers, to_api_error
from server.metrics import ServerMetrics
from server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                             TokenizeRequest)
from server.responses import (ChatCompletionResponse, CompletionResponse, DetokenizeResponse, EmbeddingResponse,
                              ErrorResponse, ModelCard,
                              ModelList, TokenizeResponse)
from server.sampling import check_model
from server.settings import ServerSettings
from server.state import ServerState, state_of
from server.tokens import TokenText

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)}
_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string", "description": "SSE when stream=true"}}}


async def _guarded(work) -> Response:
    """Run a handler; errors become OpenAI error bodies without a traceback reaching the client."""
    try:
        return await work
    except ClientGone:
        return Response(status_code=499)
    except Exception as error:
        return error_response(to_api_error(error))


def _protected_routes() -> APIRouter:
    router = APIRouter(dependencies=[Depends(check_api_key)])

    @router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(request: Request) -> ModelList:
        state = state_of(request)
        return ModelList(data=[_card(state, name) for name in state.settings.served_model_names])

    @router.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model: str, request: Request) -> ModelCard:
        state = state_of(request)
        check_model(model, state.settings)
        return _card(state, model)

    @router.post("/v1/completions", responses={200: {"model": CompletionResponse, "content": _STREAM_DOC}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guarded(create_completion(body, request, state_of(request)))

    @router.post("/v1/chat/completions",
                 responses={200: {"model": ChatCompletionResponse, "content": _STREAM_DOC}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guarded(create_chat_completion(body, request, state_of(request)))

    @router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _guarded(create_embedding(body, request, state_of(request)))

    @router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state = state_of(request)
        check_model(body.model, state.settings)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            text = render_chat(state, body.messages, template=body.chat_template or state.settings.chat_template,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message)
            ids = state.engine.tokenize(text, add_special_tokens=False)
        else:
            ids = state.engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [state.names.text(i) for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = state_of(request)
        check_model(body.model, state.settings)
        vocab = len(state.engine.tokenizer)
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=state.engine.detokenize(body.tokens))

    return router


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.started, root=state.settings.model_root,
                     max_model_len=state.engine.max_model_len)


def _public_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        if not state_of(request).engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_dead")
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict:
        return {"version": jvllm.__version__}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; shutting the app down (lifespan end) stops the engine thread."""
    metrics = ServerMetrics(engine, settings.model_name)
    engine.observers.append(metrics.observe)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = FastAPI(title="jvllm OpenAI-compatible server", version=jvllm.__version__, lifespan=lifespan)
    app.state.jvllm = ServerState(engine, settings, metrics, TokenText(engine.tokenizer))
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(_protected_routes())
    app.include_router(_public_routes())
    return app

