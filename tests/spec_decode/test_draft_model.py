"""Speculative decoding with a draft model: outputs equal those without it whatever the draft proposes, its steps are
compiled at start, and a draft model of another vocabulary is refused."""
from __future__ import annotations

import random
import shutil

import pytest

from jvllm import Engine, SamplingParams
from jvllm.worker.compile_watch import compile_watch

ENGINE = dict(dtype="float32", max_num_seqs=16, max_model_len=256, kv_cache_memory_bytes=1 << 18)


@pytest.fixture(scope="module")
def target(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def other_draft(tiny_model_factory) -> str:
    """Another tiny random model of the same vocabulary: its drafts are mostly rejected."""
    return str(tiny_model_factory("qwen2", num_hidden_layers=1))


def _prompts(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 3000) for _ in range(rng.randrange(3, 90))]} for _ in range(count)]


def _tokens(outputs) -> list:
    return [[list(o.token_ids) for o in out.outputs] for out in outputs]


def test_any_draft_keeps_the_outputs_and_the_target_drafting_itself_is_accepted(target, other_draft):
    plain = Engine(target, precompile=False, **ENGINE)
    prompts = _prompts(0, 6)
    params = [SamplingParams(temperature=0, max_tokens=24 + 3 * index, ignore_eos=True) for index in range(6)]
    params[2] = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    expected = plain.generate(prompts, params, use_tqdm=False)
    for draft, accepted_share in ((target, 0.95), (other_draft, None)):
        engine = Engine(target, precompile=False, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": 3, "max_batch_size": 8}, **ENGINE)
        got = engine.generate(prompts, params, use_tqdm=False)
        assert _tokens(got) == _tokens(expected)
        stats = engine.drafter.stats
        assert stats.num_drafts > 10
        greedy = [out.metrics for index, out in enumerate(got) if index != 2]
        drafted, accepted = sum(m.num_draft_tokens for m in greedy), sum(m.num_accepted_tokens for m in greedy)
        if accepted_share is not None:  # the same weights: only float rounding could part their greedy tokens
            assert accepted > accepted_share * drafted, stats
        else:
            assert accepted < 0.5 * drafted, stats
        engine.pages.check_integrity()
        assert engine.pages.num_free_pages == engine.pages.num_usable_pages
        draft_pages = engine.draft_model.engine.pages
        assert draft_pages.num_free_pages == draft_pages.num_usable_pages  # the draft engine keeps no request


def test_the_draft_engine_is_precompiled_with_the_target(target, other_draft):
    engine = Engine(target, max_num_batched_tokens=128, speculative_config={
        "method": "draft_model", "model": other_draft, "num_speculative_tokens": 2}, **ENGINE)
    draft = engine.draft_model.engine
    assert draft.config.max_num_seqs == 4 and draft.config.max_model_len == engine.config.max_model_len
    watch = compile_watch()
    before = watch.total
    outputs = engine.generate(_prompts(1, 3), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [30, 30, 30]
    assert engine.drafter.stats.num_drafts > 0
    assert watch.total == before, f"{watch.total - before} executables compiled after start-up"


def test_a_draft_model_of_another_vocabulary_is_refused(target, tmp_path):
    from transformers import AutoTokenizer

    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    tokenizer = AutoTokenizer.from_pretrained(draft)
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(draft)
    with pytest.raises(ValueError, match="another vocabulary"):
        Engine(target, precompile=False, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}, **ENGINE)
