"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's tail."""
from __future__ import annotations

import numpy as np


def match_lengths(corpus: np.ndarray, ends: np.ndarray, context: np.ndarray, max_length: int) -> np.ndarray:
    """For each index in `ends`, how many tokens ending there (corpus[end - m + 1 .. end]) equal the last tokens of
    `context`, up to `max_length`; the caller picks ends whose token equals context[-1]. -> [len(ends)] int."""
    depth = min(max_length, len(context))
    lengths = np.ones(len(ends), np.int64)
    if depth < 2 or not len(ends):
        return lengths
    # most ends already differ one token back: only those that match there are compared further, all at once
    alive = np.flatnonzero((ends >= 1) & (corpus[ends - 1] == context[-2]))
    if not len(alive):
        return lengths
    back = np.arange(depth)  # [D]
    positions = ends[alive, None] - back  # [A, D] corpus index `back` tokens before each end
    equal = (positions >= 0) & (corpus[np.maximum(positions, 0)] == context[::-1][:depth])  # [A, D]
    # the leading run of matches: the first mismatch's index, or all D
    lengths[alive] = np.where(equal.all(axis=1), depth, np.argmin(equal, axis=1))
    return lengths


def propose_ngram(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int, limit: int) -> list[int]:
    """tokens [>= num_tokens] int32, the sequence's first `num_tokens` known -> up to `limit` draft tokens: those
    after the latest earlier occurrence of its longest tail of min_n..max_n tokens ([] when none occurs)."""
    if num_tokens <= min_n or limit < 1:
        return []
    known = tokens[:num_tokens]
    ends = np.flatnonzero(known[:-1] == known[-1])  # earlier positions that could end a matching tail
    if not len(ends):
        return []
    lengths = match_lengths(known, ends, known, max_n)
    best = int(lengths.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(lengths == best)[-1]]) + 1
    drafts = known[start:start + limit].tolist()
    while len(drafts) < limit:  # a repeat near the end (a loop) goes on in the drafts themselves
        drafts.append(drafts[start + len(drafts) - num_tokens])
    return drafts
