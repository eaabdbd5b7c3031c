"""Request and response bodies of /v1/score and /v1/rerank (vLLM's score API; Jina's and Cohere's rerank shape)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from server.protocol import RequestBody
from server.responses import EmbeddingUsage

_TRUNCATE = ("truncate each input to k tokens (-1: the model's limit): a cross-encoder's pair loses tokens from the "
             "end of its longer text first, an embedding model's text keeps its last k tokens; without it an input "
             "over the limit is refused")


class ScoreRequest(RequestBody):
    """POST /v1/score: scores of text pairs, 1:1, 1:N or N:N."""

    model: str | None = None
    text_1: str | list[str] = Field(description="a text scored against every text_2, or a list as long as text_2 "
                                                "(element-wise pairs)")
    text_2: str | list[str] = Field(description="the texts paired with text_1")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=_TRUNCATE)


class ScoreData(BaseModel):
    index: int = Field(description="the pair's position")
    object: Literal["score"] = "score"
    score: float = Field(description="a cross-encoder's score (sigmoid of its logit unless its config names another "
                                     "activation), or the cosine similarity of the two texts' embeddings")


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(RequestBody):
    """POST /v1/rerank (also /rerank and /v2/rerank): documents ordered by their relevance to the query."""

    model: str | None = None
    query: str
    documents: list[str] = Field(description="the texts to rank (at least one)")
    top_n: int | None = Field(None, ge=0, description="how many results to return, best first (0 or unset: all)")
    return_documents: bool = Field(True, description="include each document's text in its result")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=_TRUNCATE)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in `documents`")
    document: RerankDocument | None = Field(None, description="absent with return_documents=false")
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="sorted by relevance_score, highest first")
