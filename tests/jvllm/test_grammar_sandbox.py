"""Constraint limits, the compile sandbox (crash, timeout, memory cap), choice lists as one regex, and parser-limit
errors while matching; on a small byte-level tokenizer trained here (no model needed)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from benchmarks.hostile_inputs import lark_chain, schema_ref_chain
from jvllm.sampling_params import StructuredOutputsParams as Constraint
from jvllm.structured.grammar import GrammarCompiler
from jvllm.structured.limits import GrammarLimits, plain_error, ref_chain_depth

UNBOUNDED = dict(max_bytes=1 << 30, max_choices=1 << 30, max_rules=1 << 30, max_schema_refs=1 << 30,
                 max_ref_depth=1 << 30)


@pytest.fixture(scope="module")
def tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([f"option number {i} " * 3 for i in range(200)] + ["x y z { } [ ] : , \" yes no"],
                                trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def make_compiler(tokenizer, **limits) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], limits=GrammarLimits(**limits))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    made = make_compiler(tokenizer)
    yield made
    made.close()


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def walk(state, tokenizer, text: str) -> bool:
    """Feed `text`'s tokens through the mask -> whether every token was allowed and the grammar accepts at the end."""
    for token in tokenizer.encode(text, add_special_tokens=False):
        bits = state.allowed_bits()
        if not (int(bits[token // 32]) >> (token % 32)) & 1:
            return False
        state.accept(token)
    return state.is_accepting


@pytest.mark.parametrize("constraint, message", [
    (Constraint(choice=[f"c{i}" for i in range(10_001)]), "structured_outputs.choice has 10001 options; at most 10000"),
    (Constraint(regex="a" * 600_000), "structured_outputs.regex is 600000 bytes long; at most 524288"),
    (Constraint(grammar=lark_chain(100_000)), "structured_outputs.grammar is 1877808 bytes long"),
    (Constraint(grammar=lark_chain(3_000)), "structured_outputs.grammar defines 3002 rules; at most 2000"),
    (Constraint(json=schema_ref_chain(1_000)), "structured_outputs.json has 1001 $refs; at most 1000"),
    (Constraint(json=schema_ref_chain(200)), "structured_outputs.json chains $refs 201 deep"),
    (Constraint(json=json.dumps(nested_schema(300))), "structured_outputs.json is nested 301 levels deep; at most 256"),
])
def test_constraints_over_a_limit_are_refused_before_any_compiler_runs(tokenizer, constraint, message):
    compiler = make_compiler(tokenizer)
    with pytest.raises(ValueError, match=message.replace("$", r"\$")):
        compiler.new_state(constraint)
    assert "sandbox" not in compiler.__dict__  # refused by the checks alone: no compile process was started


def test_ref_chain_depth_follows_refs_cuts_cycles_and_shares_work():
    assert ref_chain_depth(schema_ref_chain(50)) == 51  # the root's $ref, then 50 definitions' own
    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert ref_chain_depth(tree) == 1  # recursion is how trees are written: the cycle ends the chain
    diamond = {"$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
                         for i in range(60)}, "$ref": "#/$defs/d0"}
    diamond["$defs"]["d60"] = {"type": "integer"}
    started = time.perf_counter()
    assert ref_chain_depth(diamond) == 61  # 2^60 paths, each definition visited once
    assert time.perf_counter() - started < 1.0
    assert ref_chain_depth({"type": "object", "properties": {"a": {"$ref": "https://elsewhere/x"}}}) == 0


def test_a_compiler_crash_costs_one_refusal_and_the_next_constraint_compiles(tokenizer):
    # A 1 MiB sandbox stack makes a 3000-rule chain overflow it, as 10^5 rules overflowed a default thread's.
    compiler = make_compiler(tokenizer, sandbox_stack_bytes=1 << 20, **UNBOUNDED)
    try:
        assert walk(compiler.new_state(Constraint(regex="(yes|no)")), compiler._tokenizer, "yes")
        first = compiler.sandbox.pid
        with pytest.raises(ValueError, match=r"structured_outputs.grammar could not be compiled: the grammar "
                                             r"compiler crashed on it \(signal SIGSEGV: grammars nested too deeply"):
            compiler.new_state(Constraint(grammar=lark_chain(3_000)))
        assert compiler.sandbox.pid is None  # the crashed process is gone
        with pytest.raises(ValueError, match="crashed"):  # remembered: the same grammar does not crash it again
            compiler.new_state(Constraint(grammar=lark_chain(3_000)))
        assert compiler.sandbox.pid is None
        assert walk(compiler.new_state(Constraint(regex="[0-9]{3}")), compiler._tokenizer, "123")
        assert compiler.sandbox.pid not in (None, first)  # a fresh process took over
    finally:
        compiler.close()


def test_a_deep_grammar_the_sandbox_survived_compiles_in_this_process(tokenizer):
    """The sandbox's 16 MiB stack takes a 5,000-rule chain; this process compiles it on its 256 MiB thread (a
    default 8 MiB thread would overflow at ~2,900 rules)."""
    compiler = make_compiler(tokenizer, **UNBOUNDED)
    try:
        state = compiler.new_state(Constraint(grammar=lark_chain(5_000)))
        assert state.error is None and walk(state, compiler._tokenizer, "x" * 40) is False  # 40 of 5000 "x": going
        assert state.error is None
    finally:
        compiler.close()


def test_a_slow_compile_is_cut_at_the_time_limit(tokenizer):
    compiler = make_compiler(tokenizer, compile_timeout_s=0.5, **UNBOUNDED)
    slow = Constraint(grammar="start: " + " | ".join(json.dumps(f"option number {i}") for i in range(100_000)))
    try:
        started = time.perf_counter()
        with pytest.raises(ValueError, match=r"could not be compiled: it took longer than 0.5 s; simplify it"):
            compiler.new_state(slow)
        assert time.perf_counter() - started < 5
        assert walk(compiler.new_state(Constraint(choice=["yes", "no"])), compiler._tokenizer, "no")
    finally:
        compiler.close()


def test_a_compile_over_the_memory_budget_is_refused(tokenizer):
    compiler = make_compiler(tokenizer, compile_memory_bytes=24 << 20)
    many = Constraint(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3_000)}})
    try:
        with pytest.raises(ValueError, match=r"crashed on it \(signal SIGABRT: grammars too large for its memory"):
            compiler.new_state(many)
        assert walk(compiler.new_state(Constraint(choice=["yes", "no"])), compiler._tokenizer, "yes")
    finally:
        compiler.close()


def test_ten_thousand_choices_compile_to_a_mask_that_keeps_to_the_list(compiler, tokenizer):
    choices = [f"option number {i}" for i in range(10_000)]
    constraint = Constraint(choice=choices)
    for text in ("option number 0", "option number 9999", "option number 4242", "option number 10"):
        state = compiler.new_state(constraint)
        assert walk(state, tokenizer, text) and state.error is None, text
    for text in ("option number 10000", "option", "option number 01"):
        state = compiler.new_state(constraint)
        assert not walk(state, tokenizer, text), text


def test_choices_are_literals_whatever_characters_they_hold(compiler, tokenizer):
    choices = ["a.b", "(x)", "1+1", "[y]", "a|b", "^$", "back\\slash", "{2}", "ünï", "a-b", "#&~"]
    constraint = Constraint(choice=choices)
    for text in choices:
        assert walk(compiler.new_state(constraint), tokenizer, text), text
    for text in ("axb", "x", "11", "a", "b", "", "aa"):
        assert not walk(compiler.new_state(constraint), tokenizer, text), text


def test_a_parser_limit_met_while_matching_is_an_error_without_internal_text(compiler, tokenizer):
    """Lark alternatives sharing a prefix are all alive after it: 5,000 of them pass llguidance's 2,000 items."""
    wide = Constraint(grammar="start: " + " | ".join(json.dumps(f"option number {i}") for i in range(5_000)))
    state = compiler.new_state(wide)
    assert state.error is None
    walk(state, tokenizer, "option number")
    assert state.error is not None and "max is 2000" in state.error
    for internal in ("<state>", "<non-verbose/>", "backtrace", "Tokens:"):
        assert internal not in state.error
    words = state.allowed_bits()  # in error: only EOS is left, which the engine turns into finish_reason "error"
    assert [t for t in range(len(tokenizer)) if (int(words[t // 32]) >> (t % 32)) & 1] == [tokenizer.eos_token_id]


def test_compiled_constraints_are_kept_and_copied_per_request(compiler, tokenizer):
    constraint = Constraint(json={"type": "object", "properties": {"k": {"enum": ["yes", "no"]}}, "required": ["k"]})
    first = compiler.new_state(constraint)
    started = time.perf_counter()
    second = compiler.new_state(Constraint(json=json.dumps(constraint.json)))  # same schema, given as text
    assert time.perf_counter() - started < 0.05
    assert walk(first, tokenizer, '{"k": "yes"}')
    assert not second.is_accepting and walk(second, tokenizer, '{"k": "no"}')


def test_library_errors_lose_state_dumps_and_backtraces():
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n   0: <unknown>\n"
    assert plain_error(panic) == "the grammar library failed (assertion failed: grammar.symbols.len() < u16::MAX)"
    dump = "Parser Error: Current row has 5001 items; max is 2000\n<state>\nTokens: ⟦option⟧\n"
    assert plain_error(dump) == "Parser Error: Current row has 5001 items; max is 2000"
    assert len(plain_error("x" * 5000)) <= 603


def test_the_sandbox_stack_must_stay_below_this_processes(tokenizer):
    compiler = make_compiler(tokenizer, sandbox_stack_bytes=128 << 20)
    with pytest.raises(ValueError, match="must stay well below"):
        compiler.new_state(Constraint(regex="a"))


def test_bits_words_match_the_vocabulary(compiler, tokenizer):
    words = compiler.new_state(Constraint(regex="x")).allowed_bits()
    assert words.dtype == np.int32 and len(words) == (len(tokenizer) + 31) // 32
