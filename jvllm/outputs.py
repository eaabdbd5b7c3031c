"""Request/completion output dataclasses mirroring vLLM's public output types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Token lists can be tens of thousands long; reprs show only both ends.
_REPR_EDGE = 8


def _short_list(items: list[Any] | None) -> str:
    if items is None:
        return "None"
    if len(items) <= 2 * _REPR_EDGE:
        return repr(items)
    head = ", ".join(repr(x) for x in items[:_REPR_EDGE])
    tail = ", ".join(repr(x) for x in items[-_REPR_EDGE:])
    return f"[{head}, ... {tail}] (len={len(items)})"


def _short_text(text: str | None, limit: int = 200) -> str:
    if text is None or len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r}...{text[-half:]!r} (len={len(text)})"


def _short_entries(items: list | None) -> str:
    # Per-token logprob dicts are bulky; a count is what a repr reader needs.
    return "None" if items is None else f"<{len(items)} entries>"


@dataclass
class Logprob:
    """One candidate token's log-probability at one position (vLLM's `Logprob`).

    `CompletionOutput.logprobs` is a list with one `dict[token_id, Logprob]` per generated token (the
    sampled token plus the top-k asked for); `RequestOutput.prompt_logprobs` is the same per prompt
    token, with None for the first token (nothing precedes it)."""

    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the n completions of a request.

    finish_reason is "stop" (stop string / stop token / EOS), "length"
    (max_tokens or max_model_len), "abort", "error" (the request could not go
    on: `error` says why, e.g. its structured-output grammar met a parser
    limit), or None while still running.
    stop_reason is the matched stop string or stop token id, None otherwise
    (including for EOS, as in vLLM).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={_short_text(self.text)}, "
            f"token_ids={_short_list(self.token_ids)}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_short_entries(self.logprobs)}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r}"
            + (f", error={self.error!r})" if self.error else ")")
        )


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's lifecycle events."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for the request (its n members together)
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Snapshot of a request's state, returned by the engine after each step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={_short_text(self.prompt)}, "
            f"prompt_token_ids={_short_list(self.prompt_token_ids)}, "
            f"prompt_logprobs={_short_entries(self.prompt_logprobs)}, "
            f"outputs={self.outputs!r}, finished={self.finished}, "
            f"metrics={self.metrics!r}, num_cached_tokens={self.num_cached_tokens})"
        )


@dataclass
class EmbeddingOutput:
    """One prompt's pooled embedding (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size}, embedding={_short_list(self.embedding)})"


@dataclass
class EmbeddingRequestOutput:
    """The result of embedding one prompt (vLLM's `EmbeddingRequestOutput`); prompt_token_ids are the tokens
    the model saw, after any truncation."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    def __repr__(self) -> str:
        return (f"EmbeddingRequestOutput(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids={_short_list(self.prompt_token_ids)}, finished={self.finished}, "
                f"prompt={_short_text(self.prompt)})")


@dataclass
class PoolingOutput:
    """One prompt's pooled vector (vLLM's `PoolingOutput`; `data` is a NumPy array where vLLM's is a tensor)."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data=array of shape {tuple(self.data.shape)})"


@dataclass
class PoolingRequestOutput:
    """The result of LLM.encode for one prompt (vLLM's `PoolingRequestOutput`)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    def __repr__(self) -> str:
        return (f"PoolingRequestOutput(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids={_short_list(self.prompt_token_ids)}, finished={self.finished})")


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's `ScoringOutput`): a cross-encoder's classifier score, or the cosine similarity of
    the two texts' embeddings."""

    score: float

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


@dataclass
class ScoringRequestOutput:
    """The result of scoring one pair (vLLM's `ScoringRequestOutput`). prompt_token_ids are the tokens the model saw:
    a cross-encoder's pair encoding, or, as vLLM counts them for embedding models, the first text's tokens, the pad
    token and the second text's tokens."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

    def __repr__(self) -> str:
        return (f"ScoringRequestOutput(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids={_short_list(self.prompt_token_ids)}, finished={self.finished})")
