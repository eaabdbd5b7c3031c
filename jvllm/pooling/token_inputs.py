"""Token lists the pooled forwards see: single texts and text pairs, shortened as tokenizers' truncation does."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence


class InputTooLongError(ValueError):
    """An input (a text, or a pair of texts) over the model's token limit, with truncation off."""

    def __init__(self, message: str, *, index: int, num_tokens: int, limit: int):
        super().__init__(message)
        self.index, self.num_tokens, self.limit = index, num_tokens, limit


@dataclasses.dataclass(frozen=True)
class PairTokens:
    """One (text_1, text_2) pair as a cross-encoder sees it."""

    token_ids: list[int]
    token_types: list[int]  # 0 on the first text's part, 1 on the second's (BERT); all 0 for RoBERTa tokenizers


def truncate_tokens(ids: list[int], special: list[bool], limit: int, *, keep_last: bool = False) -> list[int]:
    """Shorten ids to `limit` tokens, as a tokenizer's truncation does: leading and trailing special tokens
    ([CLS] ... [SEP]; `special` marks them) stay, the content between loses its end (or, keep_last, its start)."""
    lead = next((i for i, s in enumerate(special) if not s), len(ids))
    trail = next((i for i, s in enumerate(reversed(special)) if not s), len(ids))
    room = limit - lead - trail
    if room <= 0 or lead + trail >= len(ids):  # no content to cut between the special tokens
        return ids[-limit:] if keep_last else ids[:limit]
    content = ids[lead: len(ids) - trail]
    content = content[len(content) - room:] if keep_last else content[:room]
    return ids[:lead] + content + ids[len(ids) - trail:]


def tokenize_pairs(tokenizer: Any, firsts: Sequence[str], seconds: Sequence[str], limit: int, *, truncate: bool,
                   served_name: str) -> list[PairTokens]:
    """Each (firsts[i], seconds[i]) as `tokenizer(first, second)` encodes it ([CLS] a [SEP] b [SEP] for BERT).
    A pair over `limit` tokens is shortened with 'longest_first' truncation (tokens come off the end of the longer
    text, as sentence-transformers' CrossEncoder truncates), or, with truncate=False, refused."""
    encoded = tokenizer(list(firsts), list(seconds), verbose=False)
    ids_lists = [list(ids) for ids in encoded["input_ids"]]
    type_lists = encoded.get("token_type_ids")
    types = [list(t) for t in type_lists] if type_lists is not None else [[0] * len(ids) for ids in ids_lists]
    long = [i for i, ids in enumerate(ids_lists) if len(ids) > limit]
    if long and not truncate:
        i = long[0]
        raise InputTooLongError(f"pair {i} has {len(ids_lists[i])} tokens but {served_name} takes at most {limit}; "
                                "shorten it or truncate (truncate_prompt_tokens)",
                                index=i, num_tokens=len(ids_lists[i]), limit=limit)
    if long:
        again = tokenizer([firsts[i] for i in long], [seconds[i] for i in long], truncation="longest_first",
                          max_length=limit, verbose=False)
        again_types = again.get("token_type_ids")
        for k, i in enumerate(long):
            ids_lists[i] = list(again["input_ids"][k])
            types[i] = list(again_types[k]) if again_types is not None else [0] * len(ids_lists[i])
            if len(ids_lists[i]) > limit:  # the tokenizer cannot cut below its special tokens
                raise ValueError(f"a pair cannot be truncated to {limit} tokens: its special tokens alone take "
                                 f"{tokenizer.num_special_tokens_to_add(pair=True)}")
    return [PairTokens(ids, t) for ids, t in zip(ids_lists, types)]
