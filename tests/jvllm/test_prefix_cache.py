"""Prefix caching on the default model: cached prefixes are skipped, and outputs never change because of it."""
from __future__ import annotations

import pytest

from jvllm import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer briefly, cite the rule you used, and never invent facts. "
          "If a question is ambiguous, say which reading you chose. ") * 3
QUESTIONS = ["What is 12 times 12?", "Name a prime number above 50.", "Why is the sky blue?",
             "Translate 'good morning' into French.", "What does a compiler do?"]


@pytest.fixture(scope="module")
def uncached_engine(_jvllm_cache):
    return Engine(dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_seqs=32, max_model_len=2048,
                  enable_prefix_caching=False, precompile=False)


def _prompts(engine: Engine) -> list[dict]:
    tokenizer = engine.get_tokenizer()
    return [{"prompt_token_ids": tokenizer.encode(SYSTEM + q)} for q in QUESTIONS]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_shared_system_prompt_is_computed_once_and_outputs_do_not_change(default_engine, uncached_engine):
    prompts = _prompts(default_engine)
    default_engine.reset_prefix_cache()
    want = _tokens(uncached_engine.generate(prompts, GREEDY, use_tqdm=False))
    first = default_engine.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache
    rest = default_engine.generate(prompts, GREEDY, use_tqdm=False)  # a mixed batch of hits
    assert _tokens(first) == want[:1] and _tokens(rest) == want
    shared = len(default_engine.get_tokenizer().encode(SYSTEM))
    page = default_engine.config.page_size
    assert all(o.num_cached_tokens >= (shared // page - 1) * page for o in rest)
    assert all(o.num_cached_tokens == 0 for o in uncached_engine.generate(prompts, GREEDY, use_tqdm=False))
    hits, queries = default_engine.scheduler.prefix_cache_hits, default_engine.scheduler.prefix_cache_queries
    assert 0 < hits < queries


def test_prompt_sharing_512_tokens_reports_at_least_496_cached(default_engine, uncached_engine):
    tokenizer = default_engine.get_tokenizer()
    long_ids = tokenizer.encode("The committee met on Tuesday to review the budget, the schedule and the risks. " * 40)
    assert len(long_ids) > 560
    default_engine.generate([{"prompt_token_ids": long_ids[:540]}], GREEDY, use_tqdm=False)
    follow_up = long_ids[:512] + tokenizer.encode(" In summary, what was decided?")
    output = default_engine.generate([{"prompt_token_ids": follow_up}], GREEDY, use_tqdm=False)[0]
    assert output.num_cached_tokens >= 496
    want = uncached_engine.generate([{"prompt_token_ids": follow_up}], GREEDY, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == want.outputs[0].token_ids


def test_chunked_prefill_and_preemption_with_the_cache_match_the_uncached_engine(uncached_engine):
    tight = Engine(dtype="float32", kv_cache_memory_bytes=(24 * 16) * 30 * 2 * 3 * 64 * 4, max_num_seqs=8,
                   max_model_len=512,
                   max_num_batched_tokens=48, precompile=False)  # 24 pages: too few for every request at once, prompts chunked
    prompts = _prompts(tight) * 2
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0 and tight.scheduler.prefix_cache_hits > 0
    assert _tokens(got) == _tokens(uncached_engine.generate(prompts, params, use_tqdm=False))
    tight.pages.check_integrity()
    assert tight.pages.num_free_pages == tight.pages.num_usable_pages


def test_abort_then_rerun_and_reset(default_engine):
    prompt = _prompts(default_engine)[2]
    default_engine.reset_prefix_cache()
    want = default_engine.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    default_engine.add_request("to-abort", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    default_engine.step()
    default_engine.step()
    default_engine.abort_request("to-abort")
    again = default_engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want and again.num_cached_tokens > 0
    default_engine.reset_prefix_cache()
    assert default_engine.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    default_engine.pages.check_integrity()


def test_a_prompt_continuing_a_finished_request_starts_from_its_tail_and_outputs_do_not_change(
        default_engine, uncached_engine):
    """A conversation's next turn (or a beam's next round) holds the finished request's tokens: the KV of all of
    them comes from the cache, the partial last page from a copy of the finished request's."""
    prompt = _prompts(default_engine)[3]["prompt_token_ids"]
    default_engine.reset_prefix_cache()
    first = default_engine.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    computed = len(prompt) + len(first.outputs[0].token_ids) - 1  # the last sampled token has no KV yet
    assert computed % default_engine.config.page_size, "the test needs a partial last page"
    follow = {"prompt_token_ids": prompt + list(first.outputs[0].token_ids) + [13]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    got = default_engine.generate([follow], params, use_tqdm=False)[0]
    want = uncached_engine.generate([follow], params, use_tqdm=False)[0]
    assert got.num_cached_tokens == computed
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
    default_engine.pages.check_integrity()


def test_beam_search_rounds_continue_from_tails_and_find_the_same_beams(default_engine, uncached_engine):
    from jvllm import BeamSearchParams

    prompts = [{"prompt_token_ids": p["prompt_token_ids"][:37]} for p in _prompts(default_engine)[:2]]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    default_engine.reset_prefix_cache()
    hits_before = default_engine.scheduler.prefix_cache_hits
    got = default_engine.beam_search(prompts, params)
    want = uncached_engine.beam_search(prompts, params)
    assert [[b.tokens for b in o.sequences] for o in got] == [[b.tokens for b in o.sequences] for o in want]
    for mine, theirs in zip(got, want):
        assert all(abs(a.cum_logprob - b.cum_logprob) < 1e-3 for a, b in zip(mine.sequences, theirs.sequences))
    # every round after the first finds each beam's tokens but its newest one cached
    rounds_after_first = 2 * 3 * (params.max_tokens - 1)
    assert default_engine.scheduler.prefix_cache_hits - hits_before >= rounds_after_first * 36


def test_prompt_logprobs_requests_do_not_read_the_cache(default_engine):
    prompt = _prompts(default_engine)[0]
    default_engine.generate([prompt], GREEDY, use_tqdm=False)
    output = default_engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    assert len(output.prompt_logprobs) == len(prompt["prompt_token_ids"])


def test_cache_salt_isolates_requests(default_engine):
    prompt = _prompts(default_engine)[3]
    default_engine.generate([prompt], GREEDY, use_tqdm=False)
    salted = default_engine.generate([{**prompt, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0
