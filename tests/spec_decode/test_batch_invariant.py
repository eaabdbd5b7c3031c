"""batch_invariant on the embedded 4-bit model: greedy outputs with speculative decoding are token for token those
without it, with the same logprobs to the bit (each row of a verification step computes the bits of a one-token
step), and steps that verify drafts hold at most the engine's invariant step rows (16 where the kernels' invariant
path takes the model's formats, 8 with the int16 rows of AVX2 builds)."""
from __future__ import annotations

import pathlib

import pytest

from jvllm import Engine, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]
# No prefix caching: a prompt's first token then always comes from the same prefill steps (a prefill of the uncached
# tail rounds otherwise than one of the whole prompt: batch_invariant covers steps of up to 16 rows).
ENGINE = dict(batch_invariant=True, enable_prefix_caching=False, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
              precompile=False)


def _chats() -> list[list[dict]]:
    """Copy-heavy chats (code to return with a docstring, a paragraph to quote), so drafts are verified and accepted,
    and rejected somewhere in most steps."""
    code = (ROOT / "jvllm/core/request.py").read_text().splitlines()
    asks = ["Add a docstring to this function and return the whole code:\n\n" + "\n".join(code[start:start + 14])
            for start in (86, 99)]
    asks.append("Quote the sentence of this paragraph that says how pages are found, then explain it:\n\n"
                + (ROOT / "README.md").read_text()[2000:2600])
    return [[{"role": "user", "content": ask}] for ask in asks]


@pytest.fixture(scope="module")
def without() -> Engine:
    return Engine(**ENGINE)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 5},
                                  pytest.param({"method": "suffix"}, marks=pytest.mark.extended)],  # same steps
                         ids=["ngram", "suffix"])
def test_greedy_outputs_are_those_without_speculation(without, spec):
    engine = Engine(speculative_config=spec, **ENGINE)
    chats = _chats()
    rows = []
    schedule = engine.scheduler.schedule

    def schedule_and_count_rows():
        chunks = schedule()
        if any(chunk.draft is not None for chunk in chunks):
            rows.append(sum(chunk.num_tokens for chunk in chunks))
        return chunks

    engine.scheduler.schedule = schedule_and_count_rows
    params = SamplingParams(temperature=0, max_tokens=80, logprobs=0)

    def tokens_and_logprobs(outputs) -> list[list[tuple[int, float]]]:
        return [[(token, step[token].logprob) for token, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
                for out in outputs]

    for batch in ([chats[0]], chats):  # alone, then three requests sharing steps
        expected = tokens_and_logprobs(without.chat(batch, params, use_tqdm=False))
        got = tokens_and_logprobs(engine.chat(batch, params, use_tqdm=False))
        assert got == expected  # the same bits: the logprob of every token too
    stats = engine.drafter.stats
    assert stats.num_accepted_tokens > 20, stats
    assert rows and max(rows) <= engine.invariant_step_rows, rows
    if engine.invariant_step_rows > 8:  # the invariant path: verification steps past the bf16 rows' 8
        assert max(rows) > 8, rows


def test_the_default_is_invariant_where_the_kernels_multiply_each_row_alone():
    """Unset, batch_invariant is on exactly where the native kernels give a product's rows their own bits (the
    invariant path of AVX-512 builds, the int16 rows of AVX2 builds), whatever the batched weight dtype, and the
    native kernel attends; asked for, it is what was asked."""
    from cpu_kernels.quantized_matmul import invariant_max_rows, row_path_limits
    from models.quantized import invariant_block_rows_available

    small = dict(max_model_len=1024, kv_cache_memory_bytes=64 << 20, precompile=False)
    expected = invariant_block_rows_available()
    default = Engine(**small)
    assert default.batch_invariant == expected
    assert (default.invariant_step_rows > 0) == expected
    if expected:  # the invariant path's 16 rows, else the int16 rows (8 on AVX2 builds)
        assert default.invariant_step_rows == (16 if invariant_max_rows() else row_path_limits()[0])
    assert Engine(batched_weight_dtype="none", **small).batch_invariant == expected
    assert Engine(attention_backend="xla", **small).batch_invariant is False  # attention rounds by its step's rows
    assert Engine(batch_invariant=False, **small).batch_invariant is False
