"""Speculative decoding end to end on a tiny random model: greedy and seeded outputs equal those without it over a
mixed workload, the sampled distribution is the target's (chi-square), pages, metrics and back-off."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from jvllm import Engine, SamplingParams
from jvllm.sampling_params import StructuredOutputsParams
from jvllm.spec_decode.drafter import SHARED_STEP_ROWS

ENGINE = dict(dtype="float32", max_num_seqs=32, max_model_len=256, precompile=False)
ALWAYS = 64  # max_batch_size in the tests: every batch speculates


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def plain(model) -> Engine:
    return Engine(model, kv_cache_memory_bytes=1 << 18, **ENGINE)


def _workload(plain: Engine, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of mixed lengths that hold what the model says after their end (so lookups find drafts that are
    accepted): a random piece, the model's greedy continuation of it, the piece again. With stops, min_tokens,
    n = 2, logprobs, a penalty, seeded sampling and a constraint."""
    rng = random.Random(seed)
    pieces = [[rng.randrange(5, 3000) for _ in range(rng.randrange(3, 12))] for _ in range(10)]
    said = plain.generate([{"prompt_token_ids": piece} for piece in pieces], SamplingParams(
        temperature=0, max_tokens=rng.randrange(10, 40), ignore_eos=True), use_tqdm=False)
    jobs = []
    for index, (piece, continuation) in enumerate(zip(pieces, said)):
        prompt = piece + continuation.outputs[0].token_ids + piece
        options: dict = dict(temperature=0.0, max_tokens=rng.randrange(4, 40), ignore_eos=True)
        if index % 3 == 1:
            options.update(stop_token_ids=[piece[0]], ignore_eos=False, min_tokens=2)
        if index == 2:
            options.update(n=2, temperature=0.9, seed=11)
        if index == 4:
            options.update(logprobs=2)
        if index == 5:
            options.update(repetition_penalty=1.3)
        if index == 7:
            options.update(temperature=1.0, top_k=20, seed=5)
        if index == 8:
            options.update(structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,6}x"), ignore_eos=False)
        if index == 9:  # words the request would say: the ban falls where drafts are verified
            (free,) = plain.generate({"prompt_token_ids": prompt}, SamplingParams(**options), use_tqdm=False)
            options.update(bad_words=plain.tokenizer.decode(free.outputs[0].token_ids[:6]).split()[1:3])
        jobs.append((prompt, SamplingParams(**options)))
    return jobs


def test_the_workloads_bad_words_change_its_output(plain):
    for seed in (1, 2):
        prompt, params = _workload(plain, seed)[9]
        assert params.bad_words
        free = params.clone()
        free.bad_words = None
        banned, unbanned = _run(plain, [(prompt, params), (prompt, free)])
        assert banned.outputs[0].token_ids != unbanned.outputs[0].token_ids


def _run(engine: Engine, jobs) -> list:
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in jobs]
    return engine.generate(prompts, [params for _, params in jobs], use_tqdm=False)


def _oracle(jobs, expected: list, changed: float):
    """A proposer that drafts each request's true continuation (`expected`: the outputs of `jobs` without
    speculation), as far as its limit, with a fraction `changed` of the drafts changed."""
    truth = [(prompt, out.outputs[0].token_ids) for (prompt, _), out in zip(jobs, expected)]
    rng = random.Random(0)

    def propose(tokens: np.ndarray, num_tokens: int, limit: int) -> list[int]:
        known = tokens[:num_tokens].tolist()
        for prompt, output in truth:
            if known[:len(prompt)] == prompt and known[len(prompt):] == output[:num_tokens - len(prompt)]:
                drafts = output[num_tokens - len(prompt):][:limit]
                return [token if rng.random() > changed else token + 1 for token in drafts]
        return []

    return propose


def _summary(outputs) -> list:
    return [[(o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs] for out in outputs]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5,
     "max_batch_size": ALWAYS},
    {"method": "suffix", "num_speculative_tokens": 6, "max_batch_size": ALWAYS},
    {"method": "draft_model", "num_speculative_tokens": 3, "max_batch_size": ALWAYS},
], ids=["ngram", "suffix", "draft_model"])
def test_outputs_equal_those_without_speculation(model, plain, spec):
    if spec["method"] == "draft_model":
        spec = {**spec, "model": model}  # the target itself drafts: its drafts are nearly always accepted
    # a small pool: long requests preempt each other, and drafts need pages too
    engine = Engine(model, kv_cache_memory_bytes=1 << 18, speculative_config=spec, **ENGINE)
    for seed in (1, 2):
        jobs = _workload(plain, seed)
        expected, got = _run(plain, jobs), _run(engine, jobs)
        assert _summary(got) == _summary(expected)
        with_logprobs = got[4].outputs[0].logprobs
        for mine, theirs in zip(with_logprobs, expected[4].outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            for token in mine:
                assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    stats = engine.drafter.stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens  # a random model seldom repeats: few drafts
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    engine.pages.check_integrity()
    assert engine.pages.num_free_pages == plain.pages.num_free_pages  # rejected drafts' pages came back


def test_outputs_equal_those_without_speculation_over_8_bit_pages(model):
    """8-bit KV pages (kv_cache_dtype fp8_e5m2): a verification step reads each draft's key and value as the pages
    keep them (rounded), as the decode steps without speculation do, and every prefill reads its own rounded too
    (the plain engine's prompts meet its prefix cache, the speculating one's do not): the outputs stay the same."""
    options = dict(kv_cache_memory_bytes=1 << 18, kv_cache_dtype="fp8_e5m2", **ENGINE)
    plain = Engine(model, **options)
    engine = Engine(model, speculative_config={"method": "suffix", "num_speculative_tokens": 6,
                                               "max_batch_size": ALWAYS}, **options)
    jobs = _workload(plain, 3)
    assert _summary(_run(engine, jobs)) == _summary(_run(plain, jobs))
    assert engine.drafter.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("spec, changed, longest", [
    ({"method": "ngram", "num_speculative_tokens": 7}, 0.15, 7),
    ({"method": "suffix"}, 0.04, 17),  # its default of 31 drafts: verification steps of up to 32 tokens
], ids=["7 drafts", "suffix default"])
def test_long_drafts_rejected_anywhere_keep_the_outputs(model, plain, spec, changed, longest):
    """An oracle drafter proposes each request's true continuation (from the engine without speculation) with
    a fraction `changed` of its tokens changed, so drafts are accepted up to any position (at least up to
    `longest`), and preemptions happen (a small pool)."""
    # every request its full drafts at once: steps of up to 11 x 32 token rows
    engine = Engine(model, kv_cache_memory_bytes=3 << 15, speculative_config={**spec, "max_batch_size": ALWAYS},
                    **{**ENGINE, "max_num_seqs": 512})
    engine.drafter.max_step_rows = 512
    jobs = _workload(plain, 4)
    expected = _run(plain, jobs)
    engine.drafter._proposal = _oracle(jobs, expected, changed)
    got = _run(engine, jobs)
    assert _summary(got) == _summary(expected)
    stats = engine.drafter.stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 100
    assert stats.accepted_per_position[longest - 1] > 0  # accepted up to `longest` (so at every position before)
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.scheduler.num_preemptions > 0
    engine.pages.check_integrity()
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages  # every page back (cached ones count)
    metrics = got[0].metrics
    assert sum(out.metrics.num_accepted_tokens for out in got) == stats.num_accepted_tokens
    published = engine.stats()
    assert (published.spec_decode_num_drafts, published.spec_decode_num_accepted_tokens) == (
        stats.num_drafts, stats.num_accepted_tokens)
    assert metrics.num_draft_tokens >= metrics.num_accepted_tokens


def test_requests_verifying_together_share_one_step_of_rows(model, plain):
    """With the default step limit (SHARED_STEP_ROWS), decoding requests that all could draft 31 tokens share a
    step's rows evenly; a request decoding alone verifies all 31 drafts at once."""
    engine = Engine(model, kv_cache_memory_bytes=1 << 18, speculative_config={"method": "suffix",
                                                                          "max_batch_size": ALWAYS}, **ENGINE)
    assert engine.drafter.max_step_rows == SHARED_STEP_ROWS == 32
    rng = random.Random(3)
    jobs = [([rng.randrange(5, 3000) for _ in range(8 + 3 * index)],
             SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for index, max_tokens in enumerate((100, 40, 40, 40))]
    expected = _run(plain, jobs)
    engine.drafter._proposal = _oracle(jobs, expected, 0.0)
    steps: list[list[int]] = []  # each verification step's draft counts, one per decoding request
    schedule = engine.scheduler.schedule

    def schedule_and_count_drafts():
        chunks = schedule()
        if any(chunk.draft is not None for chunk in chunks):
            assert sum(chunk.num_tokens for chunk in chunks) <= SHARED_STEP_ROWS
            steps.append([len(chunk.draft_ids) for chunk in chunks])
        return chunks

    engine.scheduler.schedule = schedule_and_count_drafts
    assert _summary(_run(engine, jobs)) == _summary(expected)
    assert [7, 7, 7, 7] in steps  # four requests: (32 - 4) // 4 drafts each
    assert [31] in steps  # the longest alone, after the others finished


def test_a_large_batch_does_not_speculate(model, plain):
    engine = Engine(model, kv_cache_memory_bytes=1 << 18, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5,
        "max_batch_size": 2}, **ENGINE)
    jobs = _workload(plain, 3)[:6]
    for _, params in jobs:
        params.max_tokens = 8
    _run(engine, jobs)
    engine.drafter.stats.num_drafts = 0
    jobs = [(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for prompt, _ in jobs]
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in jobs]
    for index, (prompt, params) in enumerate(jobs):
        engine.add_request(f"r{index}", prompts[index], params)
    for _ in range(4):  # prefill, then 6 decoding requests: over max_batch_size
        engine.step()
    assert engine.drafter.stats.num_drafts == 0
    while engine.has_unfinished_requests():
        engine.step()


def test_sampled_tokens_follow_the_target_distribution(model, plain):
    """Every step verifies drafts (a stub proposes fixed tokens); the joint distribution of the first three sampled
    tokens (top_k 3 at temperature 1.5: 27 outcomes) matches the target model's exact one, computed from logits
    without speculation."""
    from scipy import stats as scipy_stats

    engine = Engine(model, kv_cache_memory_bytes=1 << 18, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "max_batch_size": ALWAYS}, **ENGINE)
    prompt = [17, 400, 23, 99, 5]
    params = dict(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)

    def top3(context: list[int]) -> tuple[list[int], np.ndarray]:
        out = plain.generate({"prompt_token_ids": context}, SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
        entries = out.outputs[0].logprobs[0]
        tokens = sorted(entries, key=lambda t: entries[t].rank)
        scaled = np.array([entries[t].logprob for t in tokens]) / 1.5
        probs = np.exp(scaled - scaled.max())
        return tokens, probs / probs.sum()

    exact: dict[tuple[int, ...], float] = {}
    first, p1 = top3(prompt)
    for a, pa in zip(first, p1):
        second, p2 = top3(prompt + [a])
        for b, pb in zip(second, p2):
            third, p3 = top3(prompt + [a, b])
            for c, pc in zip(third, p3):
                exact[(a, b, c)] = pa * pb * pc
    # the stub drafts the likeliest continuation, so drafts are often accepted and often not
    engine.drafter._proposal = lambda tokens, num_tokens, limit: list(
        itertools.islice(itertools.cycle([second[0], third[0]]), limit))
    samples = 3000
    outputs = engine.generate([{"prompt_token_ids": prompt}] * samples,
                              [SamplingParams(seed=seed, **params) for seed in range(samples)], use_tqdm=False)
    counts = {key: 0 for key in exact}
    for out in outputs:
        counts[tuple(out.outputs[0].token_ids)] += 1
    assert sum(counts.values()) == samples
    observed = np.array([counts[key] for key in exact])
    expected = np.array([exact[key] for key in exact]) * samples
    assert expected.min() >= 5  # every outcome likely enough for the chi-square approximation
    result = scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum())
    assert result.pvalue > 1e-3, (result, observed, expected)
    assert engine.drafter.stats.num_accepted_tokens > 0
    assert engine.drafter.stats.num_accepted_tokens < engine.drafter.stats.num_draft_tokens


def test_failing_drafts_back_off(model):
    engine = Engine(model, kv_cache_memory_bytes=1 << 18, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "max_batch_size": ALWAYS}, **ENGINE)
    engine.drafter._proposal = lambda tokens, num_tokens, limit: [3] * limit  # never what the model picks
    engine.generate({"prompt_token_ids": [40, 41, 42]}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                    use_tqdm=False)
    stats = engine.drafter.stats
    assert stats.num_accepted_tokens == 0
    # it backs off to one try in 16 tokens, and keeps trying: waits of 1, 2, 4, 8, 16, 16 tokens between tries fit
    # in 60 tokens, also while async scheduling runs look-ahead steps that never ask the drafter
    assert engine.async_scheduling
    assert 6 <= stats.num_drafts <= 8
