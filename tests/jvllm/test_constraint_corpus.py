"""Every constrained output of a randomized corpus satisfies its constraint, checked by independent validators; a
grammar that meets a parser limit mid-way ends with finish_reason "error", never with an output outside it."""
from __future__ import annotations

import json

import pytest

from jvllm import SamplingParams, StructuredOutputsParams
from tests.jvllm.constraint_corpus import corpus


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    """A tiny random Llama (SmolLM2's vocabulary): near-uniform next-token odds walk far into each grammar."""
    from jvllm import Engine

    return Engine(model=str(tiny_model_factory("llama")), dtype="float32", max_num_seqs=32,
                  kv_cache_memory_bytes=64 << 20, max_model_len=512, precompile=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_output_of_a_random_corpus_satisfies_its_constraint(engine, seed):
    cases = corpus(seed)
    params = [SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=256, structured_outputs=case.constraint)
              for i, case in enumerate(cases)]
    outputs = engine.generate(["Answer:"] * len(cases), params, use_tqdm=False)
    broken, unfinished = [], []
    for case, output in zip(cases, outputs):
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            unfinished.append((case.name, completion.finish_reason, completion.error, completion.text[:80]))
        elif not case.holds(completion.text):
            broken.append((case.name, completion.text))
    assert not broken, broken
    assert not unfinished, unfinished  # every language is finite and short: each output ends well before 256 tokens
    assert len(cases) >= 120


def test_a_parser_limit_met_mid_output_ends_it_with_an_error(engine):
    """5,000 Lark alternatives sharing a prefix: past "option", 5,000 parser items are alive, over llguidance's
    2,000. The request ends with "error" and says why; the output is never passed off as finished."""
    wide = "start: " + " | ".join(json.dumps(f"option number {i}") for i in range(5_000))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=32, n=2,
                            structured_outputs=StructuredOutputsParams(grammar=wide))
    [output] = engine.generate(["Answer:"], params, use_tqdm=False)
    for completion in output.outputs:
        assert completion.finish_reason == "error", completion
        assert completion.error.startswith("the output cannot follow its structured-output constraint: Parser Error")
        assert "max is 2000" in completion.error and "<state>" not in completion.error
        assert "option".startswith(completion.text) or completion.text.startswith("option")
    free = engine.generate(["Answer:"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert free.outputs[0].finish_reason == "length"  # the engine goes on serving
