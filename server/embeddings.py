"""POST /v1/embeddings: strings or token ids to float or base64 vectors, with usage counts."""
from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jvllm.pooling.token_inputs import InputTooLongError
from server.api_errors import bad_request
from server.protocol import EmbeddingRequest
from server.responses import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from server.sampling import check_model
from server.state import ServerState


async def embedding_prompts(body: EmbeddingRequest, state: ServerState) -> list[str | dict]:
    """OpenAI's input forms (a string, strings, token ids, lists of token ids) -> Engine.embed prompts."""
    raw = body.input
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise bad_request("input must not be empty", "input")
    if body.truncate_prompt_tokens is None:  # otherwise long inputs are cut to the limit, as asked
        for i, item in enumerate(raw):
            if isinstance(item, str):
                state.limits.check_chars(len(item), "input" if len(raw) == 1 else f"input.{i}")
    # Truncation keeps at most max_model_len tokens from the end. A tail of twice the longest text those can spell
    # holds all of them, tokenized as in the whole text (the cut is max_model_len tokens away), and bounds the
    # tokenizer's work as for every other route.
    tail = 2 * state.limits.max_prompt_chars
    prompts: list[str | dict] = []
    for item in raw:
        if isinstance(item, str):
            item = item[-tail:] if len(item) > tail else item
            if not body.add_special_tokens:
                item = {"prompt": item, "prompt_token_ids": await state.tokenize(item, add_special_tokens=False)}
            prompts.append(item)
        elif not item:
            raise bad_request("a token id list in input must not be empty", "input")
        else:
            prompts.append({"prompt_token_ids": list(item)})
    return prompts


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64 carries the float32 values little-endian, as OpenAI's clients decode them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(body: EmbeddingRequest, request: Request, state: ServerState) -> Response:
    model = check_model(body.model, state.settings)
    engine = state.engine
    if engine.is_cross_encoder:
        raise bad_request(f"{model} is a cross-encoder: it scores text pairs and does not embed; use /v1/score or "
                          "/v1/rerank", "model")
    if not engine.supports_embeddings:
        raise bad_request(f"{model} is a generative model and does not support embeddings; serve an embedding "
                          "model (e.g. `jvllm serve all-MiniLM-L6-v2`)", "model")
    if body.dimensions is not None and not engine.supports_dimensions:
        raise bad_request(f"{model} does not support matryoshka representations: dimensions= cannot shorten "
                          "its embeddings", "dimensions")
    request_id = f"embd-{uuid.uuid4().hex}"
    prompts = await embedding_prompts(body, state)
    state.log_request(request_id, f"embeddings of {len(prompts)} inputs", prompts)
    try:
        outputs = await engine.embed(prompts, truncate=False, truncate_prompt_tokens=body.truncate_prompt_tokens,
                                     dimensions=body.dimensions, normalize=body.normalize)
    except InputTooLongError as error:
        raise bad_request(
            f"This model's maximum context length is {error.limit} tokens. However, input {error.index} has "
            f"{error.num_tokens} tokens. Please reduce the length of the input, or set truncate_prompt_tokens "
            f"(-1 keeps the last {error.limit} tokens).", "input") from error
    data = [EmbeddingData(index=i, embedding=encode(out.outputs.embedding, body.encoding_format))
            for i, out in enumerate(outputs)]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    response = EmbeddingResponse(id=request_id, model=model, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump())
