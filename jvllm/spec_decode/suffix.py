"""Suffix decoding: continue the longest matching suffix by its most frequent continuation, over the sequence's own
tokens and the outputs of earlier requests (a bounded cache), with a speculation length that grows with the match.

SuffixDecoding (Oliaro et al., 2024) walks suffix trees; this proposer finds the same occurrences with vectorized
scans of flat token arrays, and proposes one path (the most frequent next token at each step), not a tree."""
from __future__ import annotations

import collections
import math

import numpy as np

from jvllm.spec_decode.ngram import match_lengths

SEPARATOR = -1  # between cached outputs: never equal to a token, so no match or continuation crosses it
# The shortest match that is continued. A match of one token proposed one draft, accepted 29% of the time in
# single-stream chats of the embedded model, while a verification step costs ~1.4 one-token steps; needing 3
# tokens made every prompt kind of the benchmark 5-9% faster (docs/design/speculative_decoding.md).
MIN_MATCH = 3
# A shorter match is continued only while its continuation is near-certain: at least this many occurrences, and
# the continuation's estimated probability at least this. It drafts the fixed parts of structured answers (the
# `",\n  "` between JSON fields seen in earlier outputs), where one or two tokens of new text end every match
# (docs/design/speculative_decoding.md, has what it measured).
SHORT_MATCH_SUPPORT = 2
SHORT_MATCH_MIN_PROB = 0.9
FEW_OCCURRENCES = 64  # _continuation follows this many occurrences or fewer in Python lists


class OutputCache:
    """The outputs of the last `max_requests` finished requests, one flat array with separators."""

    def __init__(self, max_requests: int):
        self.outputs: collections.deque[np.ndarray] = collections.deque(maxlen=max_requests)
        self._flat: np.ndarray | None = None

    def add(self, output_ids: list[int]) -> None:
        if len(output_ids) > 1:
            self.outputs.append(np.asarray(output_ids, np.int32))
            self._flat = None

    @property
    def flat(self) -> np.ndarray:
        if self._flat is None:
            parts = [piece for output in self.outputs for piece in (output, np.full(1, SEPARATOR, np.int32))]
            self._flat = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return self._flat


def propose_suffix(tokens: np.ndarray, num_tokens: int, cache: OutputCache, limit: int, max_depth: int,
                   max_spec_factor: float, min_token_prob: float, min_match: int = MIN_MATCH) -> list[int]:
    """tokens [>= num_tokens] int32 (the sequence's first `num_tokens` known) -> up to `limit` draft tokens; none
    unless the sequence's last `min_match` tokens occur in the sequence or the cache, or a shorter tail does with a
    near-certain continuation (SHORT_MATCH_SUPPORT, SHORT_MATCH_MIN_PROB)."""
    if num_tokens < 2 or limit < 1:
        return []
    context = tokens[max(0, num_tokens - max_depth):num_tokens]
    own = tokens[:num_tokens]
    if len(cache.outputs):  # the cache, then the sequence, then room for the drafts (see _continuation)
        corpus = np.concatenate([cache.flat, np.full(1, SEPARATOR, np.int32), own, np.full(limit, SEPARATOR, np.int32)])
        known = len(corpus) - limit  # where the sequence ends
    else:
        corpus, known = own, num_tokens
    ends = np.flatnonzero(corpus[:known - 1] == context[-1])  # the sequence's own last token is not an occurrence
    if not len(ends):
        return []
    lengths = match_lengths(corpus, ends, context, max_depth)
    best = int(lengths.max())
    candidates = ends[lengths == best] + 1  # where each occurrence's continuation starts
    if best >= min_match:
        return _continuation(corpus, known, candidates, min(limit, max(1, math.floor(max_spec_factor * best))),
                             min_token_prob, support=1)
    return _continuation(corpus, known, candidates, limit, SHORT_MATCH_MIN_PROB, SHORT_MATCH_SUPPORT)


def _continuation(corpus: np.ndarray, known: int, candidates: np.ndarray, wanted: int, min_prob: float,
                  support: int) -> list[int]:
    """Up to `wanted` tokens continuing the occurrences whose next tokens start at `candidates`: the most frequent
    next token each time, while at least `support` (>= 1) occurrences go on and the path's probability (the product
    of the chosen tokens' frequencies) is >= min_prob. The corpus's first `known` tokens end with the sequence; each
    draft is written after them, so an occurrence in the sequence's last tokens (a repeated line, a loop) goes on in
    what it drafts itself."""
    drafts: list[int] = []
    probability = 1.0
    if len(corpus) < known + wanted:  # no room for the drafts yet (the sequence alone: a view of its buffer)
        corpus = np.concatenate([corpus[:known], np.full(wanted, SEPARATOR, np.int32)])
    # a numpy array while there are many occurrences, a list once few are left (Python is faster than numpy's calls
    # on a handful of values, the common case of a long match)
    positions: np.ndarray | list[int] = candidates
    while len(drafts) < wanted:
        end = known + len(drafts)
        if isinstance(positions, np.ndarray):
            positions = positions[positions < end]
            if len(positions) <= FEW_OCCURRENCES:
                positions = positions.tolist()
        else:
            positions = [position for position in positions if position < end]
        following = corpus[positions] if isinstance(positions, np.ndarray) else [corpus.item(p) for p in positions]
        token, count, total = _most_frequent(following)
        if total < support:
            break
        probability *= count / len(positions)
        if probability < min_prob:
            break
        corpus[end] = token
        drafts.append(token)
        if isinstance(positions, np.ndarray):
            positions = positions[following == token] + 1
        else:
            positions = [position + 1 for position, value in zip(positions, following) if value == token]
    return drafts


def _most_frequent(following: np.ndarray | list[int]) -> tuple[int, int, int]:
    """The tokens after some occurrences -> (the most frequent one other than SEPARATOR, the lowest id among ties;
    its count; how many are not SEPARATOR)."""
    if isinstance(following, np.ndarray):
        values, counts = np.unique(following[following != SEPARATOR], return_counts=True)
        if not len(values):
            return SEPARATOR, 0, 0
        top = int(np.argmax(counts))
        return int(values[top]), int(counts[top]), int(counts.sum())
    counts: dict[int, int] = {}
    for token in following:
        if token != SEPARATOR:
            counts[token] = counts.get(token, 0) + 1
    if not counts:
        return SEPARATOR, 0, 0
    token, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
    return token, count, sum(counts.values())
