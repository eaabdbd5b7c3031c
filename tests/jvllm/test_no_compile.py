"""After start-up nothing compiles: a random workload (and a beam search) runs only the precompiled step shapes, on
every backend."""
from __future__ import annotations

import random

import pytest

from jvllm import BeamSearchParams, Engine, SamplingParams
from jvllm.sampling_params import StructuredOutputsParams
from jvllm.worker.compile_watch import compile_watch

MAX_MODEL_LEN = 512
# The tiny llama keeps 256 bytes of K/V per token (2 layers x K and V x 2 heads x 16 x bfloat16: its default pages,
# its matrices being loaded in bfloat16): 40 pages of 16 tokens hold two of the longest requests (256 + 24 tokens),
# so eight running requests must preempt.
POOL_BYTES = 40 * 16 * 256
WORDS = "the a river mill children sea boats tide stone light door cat mat looked under over".split()


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 24)
    return SamplingParams(
        n=rng.choice([1, 1, 2, 3]), max_tokens=max_tokens, temperature=rng.choice([0.0, 0.7, 1.2]),
        top_k=rng.choice([0, 0, 5]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
        seed=rng.choice([None, rng.randint(0, 1000)]), logprobs=rng.choice([None, None, 0, 3, 7]),
        prompt_logprobs=rng.choice([None, None, None, 2]), stop=rng.choice([None, ["sea"], ["door", "tide"]]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]), repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        logit_bias=rng.choice([None, None, {7: 3.0}]), min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
        ignore_eos=rng.random() < 0.3, structured_outputs=rng.choice(CONSTRAINTS))


# Grammar-constrained rows take the sampler's token-mask variant, which every step shape precompiles.
CONSTRAINTS = [None, None, None, None, StructuredOutputsParams(regex="[a-z ]{1,40}"),
               StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(json_object=True)]


def drive(engine: Engine, num_requests: int, seed: int) -> dict[str, int]:
    """Requests arrive a few at a time between steps, so decode and prefill steps mix; -> what happened."""
    rng = random.Random(seed)
    pending = list(range(num_requests))
    finished, steps = 0, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                index = pending.pop()
                words = rng.randint(1, MAX_MODEL_LEN // 2 - 8)
                prompt = {"prompt_token_ids": [rng.randint(3, 4000) for _ in range(words)]}
                engine.add_request(f"r{index}", prompt, random_params(rng))
        finished += sum(out.finished for out in engine.step())
        steps += 1
    return {"finished": finished, "steps": steps, "preemptions": engine.scheduler.num_preemptions}


# The default backend takes the 60-request workload; the others walk the same shape set with fewer requests (the
# reference backend's run is extended: its steps have the default backend's shapes).
@pytest.mark.parametrize("backend, num_requests", [("cpu", 60), pytest.param("xla", 40, marks=pytest.mark.extended),
                                                   ("pallas", 12)])
def test_a_random_workload_after_start_compiles_nothing(tiny_model_factory, backend, num_requests):
    engine = Engine(str(tiny_model_factory("llama")), attention_backend=backend, max_num_seqs=8,
                    max_num_batched_tokens=128, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=POOL_BYTES)
    assert engine.config.num_pages <= 41
    chunked = []
    schedule = engine.scheduler.schedule

    def schedule_and_note_split_prompts():
        chunks = schedule()
        chunked.extend(c for c in chunks if c.start + c.num_tokens < c.request.num_prompt_tokens)
        return chunks

    engine.scheduler.schedule = schedule_and_note_split_prompts
    watch = compile_watch()
    before = watch.total
    happened = drive(engine, num_requests, seed=len(backend))
    (beams,) = engine.beam_search("Beams too", BeamSearchParams(beam_width=3, max_tokens=4))  # top-6 logprobs
    assert len(beams.sequences) == 3
    assert watch.total == before, f"{watch.total - before} executables compiled after start-up"
    assert happened["finished"] == num_requests
    assert happened["preemptions"] > 0 and chunked, happened  # the pool and the token budget were both tight
    engine.pages.check_integrity()
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages
