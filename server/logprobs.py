"""Completion- and chat-style logprobs objects from the engine's per-token `{token_id: Logprob}` dicts."""
from __future__ import annotations

import math
from typing import Any

from server.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogProbs, TopLogprob
from server.tokens import TokenText

_FLOOR = -9999.0  # JSON has no -inf; vLLM reports impossible tokens with this value


def _value(logprob: float) -> float:
    return _FLOOR if math.isinf(logprob) or math.isnan(logprob) or logprob < _FLOOR else float(logprob)


def _ranked(step: dict[int, Any]) -> list[tuple[int, Any]]:
    return sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))


def completion_logprobs(token_ids: list[int], steps: list[dict[int, Any] | None], num_top: int, names: TokenText,
                        text_offset: int = 0, as_ids: bool = False) -> CompletionLogProbs:
    """OpenAI legacy format: parallel lists; a None step (the first prompt token) has no logprob."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token_id, step in zip(token_ids, steps):
        chosen = step.get(token_id) if step else None
        token = names.text(token_id, getattr(chosen, "decoded_token", None), as_ids)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if step is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(chosen.logprob) if chosen is not None else None)
        top = {}
        for rank, (candidate, logprob) in enumerate(_ranked(step)):
            if rank < num_top or candidate == token_id:  # the top k, plus the sampled token
                top[names.text(candidate, logprob.decoded_token, as_ids)] = _value(logprob.logprob)
        tops.append(top)
    # every field set explicitly: stream chunks are dumped with exclude_unset
    return CompletionLogProbs(text_offset=offsets, token_logprobs=values, tokens=tokens, top_logprobs=tops)


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Any]], num_top: int, names: TokenText,
                  as_ids: bool = False) -> ChatLogprobs:
    """Chat format: one entry per generated token with its top alternatives (most likely first)."""
    content = []
    for token_id, step in zip(token_ids, steps):
        chosen = step.get(token_id)
        top = [TopLogprob(token=names.text(candidate, logprob.decoded_token, as_ids), logprob=_value(logprob.logprob),
                          bytes=names.bytes(candidate)) for candidate, logprob in _ranked(step)[:num_top]]
        content.append(ChatTokenLogprob(token=names.text(token_id, getattr(chosen, "decoded_token", None), as_ids),
                                        logprob=_value(chosen.logprob) if chosen is not None else _FLOOR,
                                        bytes=names.bytes(token_id), top_logprobs=top))
    return ChatLogprobs(content=content)
