"""The offline Engine API on the default model (SmolLM2-135M-Instruct, the shared `default_engine`).

Covers prompt forms and output order, per-prompt SamplingParams, finish reasons (length, EOS, stop token
ids, stop strings), chat templating, the step-level API with an abort, input validation (each error a
ValueError that leaves the engine usable), and seeded sampling that does not depend on the batch.

Compiling a new batch shape costs seconds on CPU, so the tests reuse a few short prompts (<= 8 tokens,
one KV page with 8 new tokens) and the same max_tokens wherever they can.
"""
from __future__ import annotations

import pytest

from jvllm import Engine, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_idle(engine: Engine) -> None:
    """Nothing queued or running, and every KV page back on the free list."""
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages
    engine.pages.check_integrity()


@pytest.fixture(scope="module")
def singles(default_engine):
    """prompt -> its greedy CompletionOutput, each prompt generated alone."""
    results = {}
    for prompt in PROMPTS:
        (output,) = default_engine.generate(prompt, greedy(), use_tqdm=False)
        results[prompt] = output.outputs[0]
    assert len({tuple(c.token_ids) for c in results.values()}) == len(PROMPTS), "prompts must give distinct outputs"
    return results


# ---- prompt forms, order, per-prompt params -----------------------------------------------------
def test_single_str_prompt_gives_one_output_with_length_finish(default_engine, singles):
    completion = singles[PROMPTS[0]]
    assert len(completion.token_ids) == MAX_TOKENS
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert completion.text == default_engine.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    assert completion.text.strip()
    assert_idle(default_engine)


def test_list_of_str_outputs_come_back_in_input_order(default_engine, singles):
    order = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    outputs = default_engine.generate(order, greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == order
    assert len({o.request_id for o in outputs}) == len(order)
    tokenizer = default_engine.get_tokenizer()
    for prompt, output in zip(order, outputs):
        assert output.finished
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert output.outputs[0].token_ids == singles[prompt].token_ids
        assert output.outputs[0].text == singles[prompt].text
    assert_idle(default_engine)


def test_prompt_token_ids_dicts_match_str_prompts(default_engine, singles):
    tokenizer = default_engine.get_tokenizer()
    order = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    outputs = default_engine.generate([{"prompt_token_ids": tokenizer.encode(p)} for p in order], greedy(),
                                      use_tqdm=False)
    for prompt, output in zip(order, outputs):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert output.outputs[0].token_ids == singles[prompt].token_ids
    assert_idle(default_engine)


def test_one_sampling_params_per_prompt_is_applied_to_its_prompt(default_engine, singles):
    lengths = [2, 5, MAX_TOKENS]
    outputs = default_engine.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    for prompt, n, output in zip(PROMPTS, lengths, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "length"
        assert completion.token_ids == singles[prompt].token_ids[:n]
    assert_idle(default_engine)


def test_stop_token_id_stops_at_once_with_stop_reason_the_id(default_engine, singles):
    first = singles[PROMPTS[0]].token_ids[0]
    (output,) = default_engine.generate(PROMPTS[0], greedy(stop_token_ids=[first]), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == [first]  # the stop token is kept in token_ids, as in vLLM
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == first
    assert_idle(default_engine)


# ---- chat ---------------------------------------------------------------------------------------
def _template_ids(tokenizer, conversation) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


CHAT_MATH = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
CHAT_SKY = [{"role": "user", "content": "What color is the sky? One word."}]


def test_chat_one_conversation_uses_the_template_and_stops_at_eos(default_engine):
    tokenizer = default_engine.get_tokenizer()
    (output,) = default_engine.chat(CHAT_MATH, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert output.prompt_token_ids == _template_ids(tokenizer, CHAT_MATH)
    assert output.prompt == tokenizer.apply_chat_template(CHAT_MATH, add_generation_prompt=True, tokenize=False)
    completion = output.outputs[0]
    assert completion.text.strip()
    assert "4" in completion.text
    # The reply ends with EOS (<|im_end|>): "stop" with stop_reason None, the EOS id kept in token_ids.
    assert completion.finish_reason == "stop"
    assert completion.stop_reason is None
    assert completion.token_ids[-1] in default_engine.eos_token_ids
    assert "<|im_end|>" not in completion.text
    assert_idle(default_engine)


def test_chat_list_of_conversations_keeps_order(default_engine):
    tokenizer = default_engine.get_tokenizer()
    conversations = [CHAT_SKY, CHAT_MATH]
    outputs = default_engine.chat(conversations, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert len(outputs) == 2
    for conversation, output in zip(conversations, outputs):
        assert output.prompt_token_ids == _template_ids(tokenizer, conversation)
        assert output.outputs[0].text.strip()
        assert output.outputs[0].finish_reason in ("stop", "length")
    assert "blue" in outputs[0].outputs[0].text.lower()
    assert_idle(default_engine)


# ---- step-level API -----------------------------------------------------------------------------
def test_step_api_abort_mid_way_frees_pages_and_others_complete(default_engine, singles):
    engine = default_engine
    ids = ["step-a", "step-b", "step-c"]
    for request_id, prompt in zip(ids, PROMPTS):
        engine.add_request(request_id, prompt, greedy())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("step-a", PROMPTS[0], greedy())
    assert engine.get_num_unfinished_requests() == 3

    finals, seen_tokens, steps, aborted_at = {}, {rid: 0 for rid in ids}, 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        assert steps < 50, "the engine does not make progress"
        for output in outputs:
            assert output.request_id in ids
            assert output.request_id not in finals, "an output arrived after its request finished"
            count = len(output.outputs[0].token_ids)
            assert count >= seen_tokens[output.request_id]  # outputs only grow
            seen_tokens[output.request_id] = count
            if aborted_at is not None and output.request_id == "step-b":
                assert output.finished and output.outputs[0].finish_reason == "abort"
            if output.finished:
                finals[output.request_id] = output
        if steps == 3:
            assert "step-b" not in finals and engine.pages.num_free_pages < engine.pages.num_usable_pages
            engine.abort_request("step-b")
            aborted_at = seen_tokens["step-b"]
            assert engine.get_num_unfinished_requests() == 2

    assert 0 < aborted_at < MAX_TOKENS
    assert "step-b" not in finals or finals["step-b"].outputs[0].finish_reason == "abort"
    for request_id, prompt in (("step-a", PROMPTS[0]), ("step-c", PROMPTS[2])):
        completion = finals[request_id].outputs[0]
        assert completion.finish_reason == "length"
        assert completion.token_ids == singles[prompt].token_ids
    engine.abort_request(["step-a", "no-such-request"])  # finished / unknown ids are ignored
    assert_idle(engine)



def test_generate_builds_outputs_of_finished_prompts_only_while_step_reports_every_advance(default_engine, singles,
                                                                                        monkeypatch):
    """generate() keeps only the final outputs, so it builds no RequestOutput for a prompt that goes on (per-step
    host work beside the kernels); step() still reports each prompt that advanced, as vLLM's does."""
    import jvllm.engine.llm as engine_module

    built: list[bool] = []
    real = engine_module.request_output

    def counting(request_id, members):
        output = real(request_id, members)
        built.append(output.finished)
        return output

    monkeypatch.setattr(engine_module, "request_output", counting)
    outputs = default_engine.generate(PROMPTS[:2], greedy(), use_tqdm=True)
    assert [o.outputs[0].token_ids for o in outputs] == [singles[p].token_ids for p in PROMPTS[:2]]
    assert built == [True, True]

    built.clear()
    default_engine.add_request("advance-a", PROMPTS[0], greedy())
    while default_engine.has_unfinished_requests():
        default_engine.step()
    assert built == [False] * (MAX_TOKENS - 1) + [True]
    assert_idle(default_engine)

def test_abort_of_a_waiting_request_leaves_nothing_behind(default_engine):
    default_engine.add_request("waiting-1", PROMPTS[0], greedy())
    assert default_engine.has_unfinished_requests()
    default_engine.abort_request("waiting-1")
    assert default_engine.step() == []
    assert_idle(default_engine)


# ---- bad input ----------------------------------------------------------------------------------
def _still_works(engine: Engine, singles) -> None:
    assert_idle(engine)
    (output,) = engine.generate(PROMPTS[0], greedy(), use_tqdm=False)
    assert output.outputs[0].token_ids == singles[PROMPTS[0]].token_ids
    assert_idle(engine)


@pytest.mark.parametrize("prompts", [
    pytest.param([], id="empty-prompt-list"),
    pytest.param([{"prompt_token_ids": [504] * 2049}], id="longer-than-max-model-len"),
    pytest.param([{"prompt_token_ids": []}], id="empty-token-ids"),
    pytest.param([""], id="empty-string"),
    pytest.param([{"prompt_token_ids": [504, 49152]}], id="token-id-past-vocab"),
    pytest.param([{"prompt_token_ids": [504, -1]}], id="negative-token-id"),
    pytest.param([PROMPTS[0], {"prompt_token_ids": []}], id="bad-prompt-after-a-good-one"),
    pytest.param([{"foo": "bar"}], id="dict-without-prompt"),
])
def test_bad_prompts_raise_value_error_and_engine_still_works(default_engine, singles, prompts):
    assert default_engine.config.max_model_len == 2048
    with pytest.raises(ValueError):
        default_engine.generate(prompts, greedy(), use_tqdm=False)
    _still_works(default_engine, singles)


@pytest.mark.parametrize("kwargs", [{"top_p": 0}, {"temperature": -1}, {"max_tokens": 0}, {"top_k": -5},
                                    {"n": 0}, {"stop": [""]}])
def test_invalid_sampling_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_that_do_not_fit_the_engine_raise_value_error(default_engine, singles):
    with pytest.raises(ValueError, match="stop_token_ids"):
        default_engine.generate(PROMPTS[0], greedy(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError):
        default_engine.generate(PROMPTS, [greedy()] * 2, use_tqdm=False)  # 2 params for 3 prompts
    with pytest.raises(ValueError):
        default_engine.generate(PROMPTS[0], {"temperature": 0}, use_tqdm=False)  # not a SamplingParams
    _still_works(default_engine, singles)


def test_unknown_model_path_raises_value_error(default_engine, singles):
    with pytest.raises(ValueError, match="/nonexistent"):
        Engine("/nonexistent")
    _still_works(default_engine, singles)


# ---- seeded sampling ----------------------------------------------------------------------------
SEEDED = dict(temperature=1.0, top_p=0.9, max_tokens=16)
OTHER_PROMPTS = [
    "Tell me a joke about computers.", "The weather today is", "List three colors:", "My favourite fruit is",
    "In 1492, Columbus", "import numpy as np\n", "Dear Sir or Madam,", "The best way to learn a language is",
    "Q: Why is the sea salty?\nA:", "Roses are red,", "1, 2, 3, 4,", "Breaking news:", "Hello", "Recipe: pancakes.",
    "The quick brown fox jumps over the lazy dog and then",
]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(default_engine):
    target = PROMPTS[1]
    (alone,) = default_engine.generate(target, SamplingParams(seed=1234, **SEEDED), use_tqdm=False)
    others = [
        SamplingParams(temperature=0.3 + 0.1 * i, top_p=1.0 if i % 3 else 0.8, top_k=0 if i % 2 else 20,
                       min_p=0.05 if i % 4 == 1 else 0.0, seed=i, max_tokens=16, ignore_eos=True)
        if i % 5 else SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for i in range(len(OTHER_PROMPTS))
    ]
    prompts = OTHER_PROMPTS[:7] + [target] + OTHER_PROMPTS[7:]
    params = others[:7] + [SamplingParams(seed=1234, **SEEDED)] + others[7:]
    assert len(prompts) == 16
    batch = default_engine.generate(prompts, params, use_tqdm=False)
    assert batch[7].prompt == target
    assert batch[7].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch[7].outputs[0].text == alone.outputs[0].text
    assert alone.outputs[0].text

    (again,) = default_engine.generate(target, SamplingParams(seed=1234, **SEEDED), use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = default_engine.generate(target, SamplingParams(seed=4321, **SEEDED), use_tqdm=False)
    assert other_seed.outputs[0].text != alone.outputs[0].text
    assert_idle(default_engine)


# ---- stop strings -------------------------------------------------------------------------------
def _stop_word(text: str) -> str:
    """A word of the text, from its middle, whose first occurrence is neither at the start nor the end."""
    words = [w for w in text.split() if len(w) >= 3 and w.isalpha()]
    candidates = [w for w in words if 0 < text.find(w) and text.find(w) + len(w) < len(text)]
    assert candidates, f"no usable stop word in {text!r}"
    return candidates[len(candidates) // 2]


def test_stop_string_truncates_before_it_and_is_the_stop_reason(default_engine, singles):
    prompt = PROMPTS[1]
    full = singles[prompt].text
    word = _stop_word(full)
    (output,) = default_engine.generate(prompt, greedy(stop=[word]), use_tqdm=False)
    completion = output.outputs[0]
    assert word not in completion.text
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == word
    assert completion.text == full[: full.index(word)]
    assert len(completion.token_ids) < len(singles[prompt].token_ids)
    assert completion.token_ids == singles[prompt].token_ids[: len(completion.token_ids)]
    assert_idle(default_engine)


def test_stop_string_kept_with_include_stop_str_in_output(default_engine, singles):
    prompt = PROMPTS[1]
    full = singles[prompt].text
    word = _stop_word(full)
    (output,) = default_engine.generate(prompt, greedy(stop=[word], include_stop_str_in_output=True),
                                        use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text.endswith(word)
    assert completion.text == full[: full.index(word) + len(word)]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == word
    assert_idle(default_engine)


# ---- module surface -----------------------------------------------------------------------------
def test_llm_is_engine_and_get_tokenizer_returns_the_tokenizer(default_engine):
    import jvllm

    assert jvllm.LLM is jvllm.Engine is Engine
    tokenizer = default_engine.get_tokenizer()
    assert tokenizer is default_engine.tokenizer
    assert tokenizer.decode(tokenizer.encode(PROMPTS[0])) == PROMPTS[0]
    assert tokenizer.eos_token_id in default_engine.eos_token_ids


def test_the_front_end_views_report_queues_and_running_requests(default_engine):
    """What AsyncEngine and the server read (Engine.stats, num_waiting_past_capacity, running_request_ids)."""
    engine = default_engine
    before = engine.stats()
    for name in ("view-a", "view-b"):
        engine.add_request(name, "The sky is", greedy(4))
    queued = engine.stats(num_steps=7)
    assert (queued.num_waiting, queued.num_running, queued.num_steps) == (2, 0, 7)
    assert engine.num_waiting_past_capacity() == 2 - engine.config.max_num_seqs
    engine.step()
    assert engine.running_request_ids() == {"view-a", "view-b"} and engine.stats().num_running == 2
    assert engine.stats().kv_cache_usage > before.kv_cache_usage
    engine.abort_request(["view-a", "view-b"])
    assert engine.running_request_ids() == set() and engine.stats().num_waiting == 0
    assert engine.image_token is None and not engine.supports_dimensions
    with pytest.raises(ValueError, match="is a text-only model: it takes no images"):
        engine.load_images(["data:image/png;base64,AAAA"])
    assert_idle(engine)
