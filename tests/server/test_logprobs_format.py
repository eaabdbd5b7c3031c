"""Logprobs rendering from the engine's per-token dicts: OpenAI's completion and chat shapes."""
from __future__ import annotations

import math

import pytest

from jvllm.outputs import Logprob
from server.logprobs import chat_logprobs, completion_logprobs
from server.tokens import TokenText


@pytest.fixture(scope="module")
def names(smollm_tokenizer_dir) -> TokenText:
    from transformers import AutoTokenizer

    return TokenText(AutoTokenizer.from_pretrained(smollm_tokenizer_dir))


def _step(chosen: int, chosen_logprob: float, chosen_rank: int, others: list[tuple[int, float]]) -> dict:
    step = {tid: Logprob(lp, rank) for rank, (tid, lp) in enumerate(others, start=1)}
    step[chosen] = Logprob(chosen_logprob, chosen_rank)
    return step


def test_completion_logprobs_list_tokens_offsets_and_the_top_k_plus_the_sampled_token(names):
    ids = names.tokenizer.encode(" the cat sat")
    steps = [_step(ids[0], -0.1, 1, [(ids[0], -0.1), (11, -2.5)]),
             _step(ids[1], -3.0, 3, [(5, -0.5), (6, -1.0)]),  # sampled token ranked 3rd, outside top 2
             _step(ids[2], -math.inf, 9, [(7, -0.2), (8, -0.9)])]
    result = completion_logprobs(ids, steps, 2, names, text_offset=4)
    assert "".join(result.tokens) == " the cat sat"
    assert result.text_offset == [4, 4 + len(result.tokens[0]), 4 + len(result.tokens[0]) + len(result.tokens[1])]
    assert result.token_logprobs == [-0.1, -3.0, -9999.0]  # -inf is not JSON: floored as vLLM does
    assert len(result.top_logprobs[0]) == 2
    assert result.top_logprobs[1] == {names.text(5): -0.5, names.text(6): -1.0, " cat": -3.0}
    as_ids = completion_logprobs(ids, steps, 1, names, as_ids=True)
    assert as_ids.tokens == [f"token_id:{i}" for i in ids]


def test_prompt_logprobs_start_with_none(names):
    ids = names.tokenizer.encode("Hello world")
    steps = [None] + [_step(t, -1.0, 2, [(0, -0.5)]) for t in ids[1:]]
    result = completion_logprobs(ids, steps, 1, names)
    assert result.token_logprobs[0] is None and result.top_logprobs[0] is None
    assert result.token_logprobs[1:] == [-1.0] * (len(ids) - 1)


def test_chat_logprobs_rank_alternatives_and_give_exact_bytes(names):
    text = "Ça coûte 5€ 日本"
    ids = names.tokenizer.encode(text)
    steps = [_step(t, -0.25, 1, [(t, -0.25), (100, -1.5), (101, -2.5)]) for t in ids]
    result = chat_logprobs(ids, steps, 2, names)
    assert len(result.content) == len(ids)
    assert b"".join(bytes(item.bytes) for item in result.content) == text.encode("utf-8")
    for item, token_id in zip(result.content, ids):
        assert item.logprob == -0.25
        assert [t.logprob for t in item.top_logprobs] == [-0.25, -1.5]
        assert item.top_logprobs[0].token == item.token
    assert chat_logprobs(ids, steps, 0, names).content[0].top_logprobs == []
