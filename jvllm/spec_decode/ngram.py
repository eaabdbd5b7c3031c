"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's tail."""
from __future__ import annotations

import numpy as np


def match_lengths(corpus: np.ndarray, ends: np.ndarray, context: np.ndarray, max_length: int) -> np.ndarray:
    """For each index in `ends`, how many tokens ending there (corpus[end - m + 1 .. end]) equal the last tokens of
    `context`, up to `max_length`; the caller picks ends whose token equals context[-1]. -> [len(ends)] int."""
    lengths = np.ones(len(ends), np.int64)
    alive = np.arange(len(ends))
    for back in range(1, min(max_length, len(context))):
        alive = alive[ends[alive] >= back]
        alive = alive[corpus[ends[alive] - back] == context[-1 - back]]
        if not len(alive):
            break
        lengths[alive] += 1
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
