"""SamplingParams.bad_words on the default model: the words' token sequences, and greedy outputs that follow the
unconstrained ones until a banned sequence would complete, where they take the best token left."""
from __future__ import annotations

import pytest

from jvllm import SamplingParams
from jvllm.core.bad_words import bad_word_ids, banned_next

PROMPT = "The capital of France is"


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, **kwargs})


def test_sequences_cover_the_word_at_the_start_and_after_a_space(default_engine):
    tokenizer = default_engine.tokenizer
    sequences = bad_word_ids(tokenizer, ["Paris", " Paris"])  # the same word twice: no duplicates
    assert sequences == (tuple(tokenizer.encode("Paris", add_special_tokens=False)),
                         tuple(tokenizer.encode(" Paris", add_special_tokens=False)))
    assert banned_next(((7,), (1, 2, 3)), [9, 1, 2]) == [7, 3]
    assert banned_next(((7,), (1, 2, 3)), [1, 2, 9]) == [7]
    assert banned_next(((1, 2, 3),), [2]) == []


def _best_allowed(step: dict, banned: set[int]) -> int:
    return max((tid for tid in step if tid not in banned), key=lambda tid: step[tid].logprob)


def _first_completion(ids: list[int], sequences) -> int | None:
    """The index of the output token that first completes one of `sequences`, if any."""
    for end in range(len(ids)):
        if any(tuple(ids[end + 1 - len(s):end + 1]) == s for s in sequences if end + 1 >= len(s)):
            return end
    return None


@pytest.mark.parametrize("pick", ["one token", "several tokens"])
def test_greedy_output_avoids_the_word_and_otherwise_follows_the_unconstrained_one(default_engine, pick):
    tokenizer = default_engine.tokenizer
    (free,) = default_engine.generate(PROMPT, greedy(logprobs=5), use_tqdm=False)
    ids = free.outputs[0].token_ids
    words = [w for w in free.outputs[0].text.split() if w.isalpha()]
    if pick == "several tokens":  # a phrase: the words of this model's outputs are one token each
        words = [f"{a} {b}" for a, b in zip(words, words[1:])]
    wanted = (lambda n: n == 1) if pick == "one token" else (lambda n: n >= 2)
    word = next(w for w in words if wanted(len(tokenizer.encode(" " + w, add_special_tokens=False)))
                and _first_completion(ids, bad_word_ids(tokenizer, [w])) is not None)
    sequences = bad_word_ids(tokenizer, [word])
    (banned,) = default_engine.generate(PROMPT, greedy(logprobs=5, bad_words=[word]), use_tqdm=False)
    out = banned.outputs[0].token_ids
    assert _first_completion(out, sequences) is None, (word, banned.outputs[0].text)
    end = _first_completion(ids, sequences)
    assert out[:end] == ids[:end]
    blocked = set(banned_next(sequences, ids[:end]))
    assert ids[end] in blocked and out[end] == _best_allowed(free.outputs[0].logprobs[end], blocked)


def test_bad_words_are_checked():
    for value in ("Paris", [""], ["  "], [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=value)
