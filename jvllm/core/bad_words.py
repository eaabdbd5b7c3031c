"""SamplingParams.bad_words, as vLLM applies them: each word is banned as a token sequence, both where it starts the
text and after a space; the last token of a sequence is blocked whenever the output so far ends with the others."""
from __future__ import annotations

from typing import Any, Sequence

BadWordIds = tuple[tuple[int, ...], ...]


def bad_word_ids(tokenizer: Any, words: Sequence[str] | None) -> BadWordIds:
    """The token sequences of `words`: each as it starts a text and, where that tokenizes differently, after a
    space (without special tokens); no duplicates."""
    sequences: list[tuple[int, ...]] = []
    for word in words or ():
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)


def banned_next(sequences: BadWordIds, output_ids: Sequence[int]) -> list[int]:
    """Tokens the next sample may not be: each sequence's last token where `output_ids` ends with the tokens
    before it (always, for a one-token sequence)."""
    banned = []
    for sequence in sequences:
        head = sequence[:-1]
        if not head or (len(output_ids) >= len(head) and tuple(output_ids[len(output_ids) - len(head):]) == head):
            banned.append(sequence[-1])
    return banned


def follows_output(sequences: BadWordIds) -> bool:
    """Whether what is banned depends on the output so far (a sequence of two or more tokens)."""
    return any(len(sequence) > 1 for sequence in sequences)
