"""The FastAPI application: OpenAI-compatible /v1 routes, tokenizer routes, health, version, metrics."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import jvllm
from jvllm.engine.async_engine import AsyncEngine
from server.anthropic_messages import anthropic_routes
from server.auth import check_api_key
from server.blocking import BlockingWork, json_in_pieces
from server.body_limit import BodySizeLimit
from server.chat import create_chat_completion, render_chat
from server.completions import create_completion
from server.embeddings import create_embedding
from server.api_errors import ClientGone, bad_request
from server.errors import error_response, install_error_handlers, route_path, to_api_error
from server.limits import AdmissionLimits
from server.memory_trim import TrimAfterLargeBodies
from server.metrics import ServerMetrics
from server.openapi_streams import document_event_streams, streamed
from server.request_id import RequestIdHeader
from server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                             TokenizeRequest)
from server.responses import (ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, DetokenizeResponse,
                              EmbeddingResponse, ErrorResponse, ModelCard, ModelList, TokenizeResponse)
from server.responses_api import create_response, retrieve_response
from server.responses_api_protocol import ResponseObject, ResponsesRequest, ResponseStreamEvent
from server.sagemaker import sagemaker_routes
from server.sampling import check_model
from server.score import score_routes
from server.settings import ServerSettings
from server.state import ServerState, engine_health, state_of
from server.tokens import TokenText
from server.web_page import install_web_page

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}


access_logger = logging.getLogger("uvicorn.access")


async def _guarded(request: Request, work: Awaitable[Response]) -> Response:
    """Run a handler; errors become OpenAI error bodies (Anthropic's on its routes) without a traceback reaching
    the client. A client that left gets no response: its line in the access log says 499, as nginx logs one."""
    try:
        return await work
    except ClientGone:
        client = request.client
        access_logger.info('%s - "%s %s HTTP/%s" %d', f"{client.host}:{client.port}" if client else "-",
                           request.method, request.url.path, request.scope.get("http_version", "1.1"), 499)
        return Response(status_code=499)
    except Exception as error:
        return error_response(to_api_error(error), route_path(request.scope))


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

    @router.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS},
                 openapi_extra=streamed(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guarded(request, create_completion(body, request, state_of(request)))

    @router.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
                 openapi_extra=streamed(ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guarded(request, create_chat_completion(body, request, state_of(request)))

    @router.post("/v1/responses", responses={200: {"model": ResponseObject}, **_ERRORS},
                 openapi_extra=streamed(ResponseStreamEvent))
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _guarded(request, create_response(body, request, state_of(request)))

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def get_response(response_id: str, request: Request) -> Response:
        return await _guarded(request, retrieve_response(response_id, state_of(request)))

    @router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _guarded(request, create_embedding(body, request, state_of(request)))

    @router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        return await _guarded(request, _tokenize(body, state_of(request)))

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return await _guarded(request, _detokenize(body, state_of(request)))

    return router


async def _tokenize(body: TokenizeRequest, state: ServerState) -> Response:
    check_model(body.model, state.settings)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:  # render_chat bounds the messages' characters
        text = await render_chat(state, body.messages, request_template=body.chat_template,
                                 add_generation_prompt=body.add_generation_prompt,
                                 continue_final_message=body.continue_final_message, extra=body.chat_template_kwargs)
        ids = await state.tokenize(text, add_special_tokens=False)
    else:
        state.limits.check_chars(len(body.prompt), "prompt")
        ids = await state.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)

    def encode() -> bytes:  # a million ids encode in a few hundred ms: on the pool, in pieces
        strs = [state.names.text(i) for i in ids] if body.return_token_strs else None
        return json_in_pieces(dict(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids,
                                   token_strs=strs))

    return Response(await state.blocking.run(encode), media_type="application/json")


async def _detokenize(body: DetokenizeRequest, state: ServerState) -> Response:
    check_model(body.model, state.settings)
    vocab = len(state.engine.tokenizer)
    state.limits.check_tokens(len(body.tokens), "tokens")

    def decode() -> str | None:
        if any(t < 0 or t >= vocab for t in body.tokens):
            return None
        return state.engine.detokenize(body.tokens)

    text = await state.blocking.run(decode)
    if text is None:
        raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.started, root=state.settings.model_root,
                     max_model_len=state.engine.max_model_len)


def _public_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_class=Response,
                responses={200: {"description": "the engine is running (empty body)", "content": {}},
                           503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        return engine_health(request)

    @router.get("/version")
    async def version() -> dict:
        return {"version": jvllm.__version__}

    @router.get("/metrics", response_class=PlainTextResponse,
                responses={200: {"description": "Prometheus text format",
                                 "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; shutting the app down (lifespan end) stops the engine thread."""
    if not settings.served_model_names:
        raise ValueError("the server needs at least one served model name")
    metrics = ServerMetrics(engine, settings.model_name)
    engine.observers.append(metrics.observe)
    config = engine.config
    limits = AdmissionLimits.resolve(max_num_seqs=config.max_num_seqs, max_waiting_requests=engine.max_waiting_requests,
                                     max_model_len=config.max_model_len, tokenizer=engine.tokenizer,
                                     max_n=settings.max_n, max_prompt_chars=settings.max_prompt_chars)
    blocking = BlockingWork()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()
        blocking.close()

    docs = {} if not settings.disable_fastapi_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="jvllm OpenAI-compatible server", version=jvllm.__version__, lifespan=lifespan, **docs)
    app.state.jvllm = ServerState(engine, settings, metrics, TokenText(engine.tokenizer), limits, blocking)
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(_protected_routes())
    app.include_router(anthropic_routes(_guarded))
    app.include_router(score_routes(_guarded))
    app.include_router(sagemaker_routes(_guarded))
    app.include_router(_public_routes())
    if not settings.disable_web_ui:
        install_web_page(app)
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                       allow_credentials=settings.allow_credentials)
    app.add_middleware(TrimAfterLargeBodies)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_bytes)
    if settings.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    document_event_streams(app)
    return app
