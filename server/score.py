"""POST /v1/score and /v1/rerank (also vLLM's /score, /rerank and /v2/rerank): text-pair scores from a
cross-encoder, or the cosine similarity of an embedding model's embeddings."""
from __future__ import annotations

import uuid
from typing import Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from jvllm.outputs import ScoringRequestOutput
from jvllm.pooling.token_inputs import InputTooLongError
from server.auth import check_api_key
from server.api_errors import bad_request
from server.responses import EmbeddingUsage, ErrorResponse
from server.sampling import check_model
from server.score_protocol import (RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage,
                                   ScoreData, ScoreRequest, ScoreResponse)
from server.state import ServerState, state_of

Guard = Callable[[Request, Awaitable[Response]], Awaitable[Response]]
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}


def _texts(value: str | list[str], param: str, state: ServerState, *, keep_head: bool,
           truncating: bool) -> list[str]:
    """A request's texts, bounded before any tokenizing: at most as many as the server holds at once, each at
    most the characters max_model_len tokens can spell (longer ones refused, or, when truncating, cut to twice that:
    the tokens truncation keeps are all in the part kept, tokenized as in the whole text)."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise bad_request(f"{param} must hold at least one text", param)
    if len(texts) > state.limits.max_sequences:
        raise bad_request(f"{param} has {len(texts)} texts; at most {state.limits.max_sequences} are scored in one "
                          "request (--max-num-seqs plus --max-waiting-requests): split it into smaller requests", param)
    keep = 2 * state.limits.max_prompt_chars
    out = []
    for i, text in enumerate(texts):
        if not truncating:
            state.limits.check_chars(len(text), param if isinstance(value, str) else f"{param}.{i}")
        elif len(text) > keep:
            text = text[:keep] if keep_head else text[-keep:]
        out.append(text)
    return out


async def _score(state: ServerState, model: str, firsts: list[str], seconds: list[str],
                 truncate_prompt_tokens: int | None, names: tuple[str, str]) -> list[ScoringRequestOutput]:
    """Run the pairs (on the engine's pooling worker); a pair or text over the limit is a 400 naming it."""
    engine = state.engine
    if not engine.supports_scoring:
        raise bad_request(f"{model} is a generative model and does not support scoring; serve a cross-encoder (a "
                          "*ForSequenceClassification checkpoint) or an embedding model (e.g. `jvllm serve "
                          "all-MiniLM-L6-v2`)", "model")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise bad_request(f"{names[0]} has {len(firsts)} texts and {names[1]} has {len(seconds)}: pairs are 1:1, "
                          f"1:N or N:N ({names[0]} one text, or as many as {names[1]})", names[0])
    try:
        return await engine.score(firsts, seconds, truncate=False, truncate_prompt_tokens=truncate_prompt_tokens)
    except InputTooLongError as error:
        if engine.is_cross_encoder:
            what, param = f"pair {error.index} ({names[0]} and {names[1]})", names[1]
        elif error.index < len(firsts):
            what, param = f"{names[0]} {error.index}", names[0]
        else:
            what, param = f"{names[1]} {error.index - len(firsts)}", names[1]
        raise bad_request(f"This model's maximum context length is {error.limit} tokens. However, {what} has "
                          f"{error.num_tokens} tokens. Please reduce the length of the input, or set "
                          "truncate_prompt_tokens (-1 truncates to the model's limit).", param) from error


async def _scored_request(state: ServerState, kind: str, model_name: str | None, first: str | list[str],
                          second: str | list[str], truncate_prompt_tokens: int | None,
                          names: tuple[str, str]) -> tuple[str, str, list[ScoringRequestOutput]]:
    """One score or rerank request's pairs checked, bounded, logged and run -> (request id, model, outputs)."""
    model = check_model(model_name, state.settings)
    cross, truncating = state.engine.is_cross_encoder, truncate_prompt_tokens is not None
    firsts = _texts(first, names[0], state, keep_head=cross, truncating=truncating)
    seconds = _texts(second, names[1], state, keep_head=cross, truncating=truncating)
    request_id = f"{kind}-{uuid.uuid4().hex}"
    state.log_request(request_id, f"{kind} of {len(firsts)} x {len(seconds)} texts", (firsts, seconds))
    return request_id, model, await _score(state, model, firsts, seconds, truncate_prompt_tokens, names)


async def create_score(body: ScoreRequest, state: ServerState) -> Response:
    request_id, model, outputs = await _scored_request(state, "score", body.model, body.text_1, body.text_2,
                                                       body.truncate_prompt_tokens, ("text_1", "text_2"))
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    response = ScoreResponse(id=request_id, model=model,
                             data=[ScoreData(index=i, score=out.outputs.score) for i, out in enumerate(outputs)],
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump())


async def create_rerank(body: RerankRequest, state: ServerState) -> Response:
    request_id, model, outputs = await _scored_request(state, "rerank", body.model, body.query, body.documents,
                                                       body.truncate_prompt_tokens, ("query", "documents"))
    order = sorted(range(len(outputs)), key=lambda i: -outputs[i].outputs.score)  # stable: ties keep input order
    top_n = body.top_n or len(outputs)
    results = [RerankResult(index=i, relevance_score=outputs[i].outputs.score,
                            document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
               for i in order[:top_n]]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    response = RerankResponse(id=request_id, model=model, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump(exclude_none=True))


def score_routes(guarded: Guard) -> APIRouter:
    """The routes, behind the API key; `guarded` turns a handler's errors into OpenAI error responses."""
    router = APIRouter(dependencies=[Depends(check_api_key)])

    async def score(body: ScoreRequest, request: Request) -> Response:
        return await guarded(request, create_score(body, state_of(request)))

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await guarded(request, create_rerank(body, state_of(request)))

    for path in ("/v1/score", "/score"):
        router.add_api_route(path, score, methods=["POST"], response_model=ScoreResponse, responses=_ERRORS)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"], response_model=RerankResponse, responses=_ERRORS)
    return router
