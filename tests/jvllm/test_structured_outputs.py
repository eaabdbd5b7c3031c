"""Structured outputs on the default model: JSON schemas, regex, choice and grammars hold in every output, mixed
batches leave unconstrained rows untouched, and bad constraints are ValueErrors naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jvllm import SamplingParams, StructuredOutputsParams
from benchmarks.json_schemas import SCHEMAS

pytestmark = pytest.mark.slow

LARK_LIST = """
start: "[" item ("," item)* "]"
item: /[0-9]{1,3}/
"""


def _chat(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with {what} as JSON."}]


def test_outputs_of_32_json_schemas_all_validate(default_engine):
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in SCHEMAS]
    outs = default_engine.chat([_chat(what) for what, _ in SCHEMAS], params, use_tqdm=False)
    assert len(SCHEMAS) >= 30
    for (what, schema), out in zip(SCHEMAS, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (what, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_grammar_and_json_object_hold_and_unconstrained_rows_keep_their_solo_output(default_engine):
    free_prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    free_params = [SamplingParams(temperature=0.0, max_tokens=24),
                   SamplingParams(temperature=0.9, seed=7, max_tokens=24),
                   SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=24)]
    solo = [default_engine.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(free_prompts, free_params)]
    constrained = [
        ("My phone number is", SamplingParams(temperature=0.8, seed=1, max_tokens=30,
                                              structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))),
        ("The best pet is a", SamplingParams(temperature=0.0, max_tokens=10,
                                             structured_outputs=StructuredOutputsParams(choice=["cat", "dog", "fish"]))),
        ("Some numbers:", SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                         structured_outputs=StructuredOutputsParams(grammar=LARK_LIST))),
        ("A JSON object:", SamplingParams(temperature=0.0, max_tokens=60,
                                          structured_outputs=StructuredOutputsParams(json_object=True))),
    ]
    prompts = [p for p, _ in constrained] + free_prompts
    outs = default_engine.generate(prompts, [sp for _, sp in constrained] + free_params, use_tqdm=False)
    phone, pet, numbers, obj = (o.outputs[0] for o in outs[:4])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text) and phone.finish_reason == "stop"
    assert pet.text in ("cat", "dog", "fish") and pet.finish_reason == "stop"
    assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", numbers.text), numbers.text
    assert isinstance(json.loads(obj.text), dict)
    assert [o.outputs[0].token_ids for o in outs[4:]] == solo


def test_eos_comes_exactly_when_the_grammar_accepts(default_engine):
    """Before the grammar is complete EOS is masked (even with min_tokens 0); once complete only EOS is left."""
    eos = default_engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=50,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{12}"))
    out = default_engine.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{12}", out.text)
    assert out.finish_reason == "stop" and out.stop_reason is None  # ended by EOS, right after the 12th digit
    assert out.token_ids[-1] in eos and not any(t in eos for t in out.token_ids[:-1])


def test_n_completions_and_stop_strings_each_follow_the_grammar(default_engine):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex="(red|green|blue)( (red|green|blue)){2,6}"))
    outs = default_engine.generate("Three colours:", params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for out in outs:
        assert re.fullmatch("(red|green|blue)( (red|green|blue)){2,6}", out.text), out.text
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop=[" blue"],
                             structured_outputs=StructuredOutputsParams(regex="(blue )+"))
    out = default_engine.generate("Colours:", stopped, use_tqdm=False)[0].outputs[0]
    assert out.text == "blue" and out.stop_reason == " blue"


def test_a_repeated_prompt_hits_the_prefix_cache_and_gives_the_same_constrained_output(default_engine):
    prompt = "Give three fruits as a JSON list of strings. " * 4
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json={"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}))
    first = default_engine.generate(prompt, params, use_tqdm=False)[0]
    second = default_engine.generate(prompt, params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(json.loads(first.outputs[0].text)) == 3


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(json={"type": "object", "not": {"type": "string"}}), "not"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json is not valid JSON"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_constraints_that_do_not_compile_are_value_errors_and_queue_nothing(default_engine, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        default_engine.generate("Hi", SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert not default_engine.has_unfinished_requests()


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "string"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(choice=("a", "b")).kind == "choice"


def test_a_reasoning_reply_is_free_until_its_thinking_ends(default_engine):
    """With a reasoning parser, the grammar starts after `</think>`: no mask while thinking, then the JSON
    grammar's mask; text after `</think>` in the same token is fed to the grammar."""
    from jvllm.sample.tensors import pack_token_bits
    from jvllm.structured.grammar import GrammarCompiler, reasoning_open

    tokenizer = default_engine.get_tokenizer()
    vocab = default_engine.model.config.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, default_engine.eos_token_ids, "deepseek_r1")
    state = compiler.new_state(StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}), prompt_tail="<|im_start|>assistant\n<think>\n")
    for token in tokenizer.encode("Let me think about {braces} here.", add_special_tokens=False):
        assert state.allowed_bits() is None
        assert state.accept(token)
    for token in tokenizer.encode("</think>{", add_special_tokens=False):
        assert state.accept(token)
    bits = state.allowed_bits()
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert bits is not None and bits.shape == pack_token_bits(np.zeros(vocab, bool)).shape
    assert bits[quote // 32] >> (quote % 32) & 1 and not bits[letter // 32] >> (letter % 32) & 1  # inside `{`
    assert reasoning_open("deepseek_r1", "assistant\n") and not reasoning_open("qwen3", "assistant\n")
    assert not reasoning_open("qwen3", "<think>\n\n</think>\n\n") and reasoning_open("qwen3", "x <think>\n")
