"""Sample and prompt logprobs against transformers' log_softmax on the default model (float32).

Logprobs are of the raw model distribution (vLLM's default), so they can be checked position by position
against transformers' logits of the full sequence (prompt + generated tokens)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jvllm import Engine, SamplingParams  # noqa: E402

# Logits of the 30-layer model agree to ~1.4e-4 (see test_llama_parity); log_softmax keeps that order.
LOGPROB_ATOL = 1e-3
PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "Once upon a time, in a village by the sea, there lived an old fisherman who"]


def _reference_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """[len(ids), V] log_softmax of transformers' logits at every position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check_entry(entry: dict, token_id: int, k: int, ref_row: np.ndarray) -> None:
    """One position's {token_id: Logprob}: every value is the reference's, the target's rank is right (up to
    near-ties), and the entries ranked 1..k are the reference's k largest logprobs."""
    assert token_id in entry
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(ref_row[tid], abs=LOGPROB_ATOL)
        assert lp.decoded_token is not None
    target = ref_row[token_id]
    assert 1 + (ref_row > target + LOGPROB_ATOL).sum() <= entry[token_id].rank <= 1 + (ref_row > target - LOGPROB_ATOL).sum()
    top = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= k)
    assert [rank for rank, _ in top] == list(range(1, k + 1))
    np.testing.assert_allclose([lp for _, lp in top], np.sort(ref_row)[::-1][:k], atol=LOGPROB_ATOL)


def test_sample_and_prompt_logprobs_match_transformers(default_engine, hf_smollm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    outputs = default_engine.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        full = output.prompt_token_ids + completion.token_ids
        ref = _reference_logprobs(hf_smollm, full)
        num_prompt = len(output.prompt_token_ids)
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_entry(entry, token_id, 5, ref[num_prompt + i - 1])
            assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), abs=1e-4)
        assert len(output.prompt_logprobs) == num_prompt and output.prompt_logprobs[0] is None
        for j in range(1, num_prompt):
            _check_entry(output.prompt_logprobs[j], output.prompt_token_ids[j], 3, ref[j - 1])


def test_seeded_random_sample_logprob_is_the_model_distribution(default_engine, hf_smollm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
    output = default_engine.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    ref = _reference_logprobs(hf_smollm, output.prompt_token_ids + completion.token_ids)
    num_prompt = len(output.prompt_token_ids)
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert list(entry) == [token_id]  # logprobs=0: only the sampled token
        assert entry[token_id].logprob == pytest.approx(ref[num_prompt + i - 1][token_id], abs=LOGPROB_ATOL)


def test_prompt_logprobs_survive_chunked_prefill(default_engine):
    """A prompt split over several steps gets one entry per token, equal to the one-shot values."""
    ids = default_engine.get_tokenizer().encode(PROMPTS[2] * 3)
    assert len(ids) > 40
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    one_shot = default_engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
    chunked_engine = Engine(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512,
                            max_num_batched_tokens=16, precompile=False)
    chunked = chunked_engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
    assert len(one_shot) == len(chunked) == len(ids)
    for a, b in zip(one_shot[1:], chunked[1:]):
        assert a.keys() == b.keys()
        for tid in a:
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)
            assert a[tid].rank == b[tid].rank


def test_logprobs_off_by_default_and_limited(default_engine):
    output = default_engine.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert output.outputs[0].logprobs is None and output.prompt_logprobs is None
    assert output.outputs[0].cumulative_logprob is None  # as vLLM: summed only when logprobs are asked for
    single = default_engine.generate(["Hi"], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(single.prompt_logprobs) == len(single.prompt_token_ids)
    with pytest.raises(ValueError, match="logprobs=21 exceeds the maximum of 20"):
        default_engine.generate(["Hi"], SamplingParams(logprobs=21), use_tqdm=False)
    assert default_engine.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)[0].finished
