"""Grammars for structured outputs: compiled by llguidance, advanced on the host, read as packed token bitmasks."""
from __future__ import annotations

import functools
import json
from typing import Any, Sequence

import llguidance
import llguidance.hf
import numpy as np

from jvllm.sampling_params import StructuredOutputsParams

ANY_JSON_OBJECT = {"type": "object"}
# Between JSON tokens: at most one line break and an indentation, enough for pretty-printed JSON. Unbounded
# whitespace (JSON's own rule) lets small models loop on newlines until max_tokens, leaving invalid JSON.
# A schema's own "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x09]{0,2}(\x0D?\x0A[\x20\x09]{0,32})?"}


# What ends the reasoning of each --reasoning-parser: the grammar applies to the text after it.
REASONING_ENDS = {"deepseek_r1": "</think>", "qwen3": "</think>"}
THINK_START = "<think>"


def reasoning_open(parser: str, prompt_tail: str) -> bool:
    """Whether the reply starts inside a thinking block: the prompt's chat template opened one and did not close
    it, or (deepseek_r1, which always thinks first) the prompt shows neither tag."""
    start, end = prompt_tail.rfind(THINK_START), prompt_tail.rfind(REASONING_ENDS[parser])
    if start != end:
        return start > end
    return parser == "deepseek_r1"


class GrammarState:
    """One sequence's place in its grammar: accepts the tokens it samples, says which tokens may come next.
    With `after` (a reasoning model's end-of-thinking text), tokens are free until that text has been written."""

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, tokenizer: llguidance.LLTokenizer,
                 after: str | None = None):
        self._matcher = matcher
        self._num_words = num_words
        self._tokenizer = tokenizer
        self._after = None if after is None else after.encode()
        self._reasoning = b""  # output bytes so far while waiting for `after`

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and an error state: only EOS is allowed after) if it broke the
        grammar, which masking prevents except for tokens sampled outside it (EOS under ignore_eos)."""
        if self._after is None:
            return self._matcher.consume_token(int(token_id))
        self._reasoning += self._tokenizer.decode_bytes([int(token_id)])
        _, found, rest = self._reasoning.partition(self._after)
        if found:
            self._after = None
            if rest.strip():  # the token that ended the reasoning also began the answer
                return self._matcher.consume_tokens(self._tokenizer.tokenize_bytes(rest))
        return True

    def allowed_bits(self) -> np.ndarray | None:
        """[W] int32: bit t % 32 of word t // 32 is set when token t may come next; None while reasoning."""
        if self._after is not None:
            return None
        words = np.frombuffer(self._matcher.compute_bitmask(), np.int32)
        return words[: self._num_words]

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def copy(self) -> GrammarState:
        state = GrammarState(self._matcher.deep_copy(), self._num_words, self._tokenizer)
        state._after, state._reasoning = self._after, self._reasoning
        return state


class GrammarCompiler:
    """Turns StructuredOutputsParams into grammar states for one tokenizer and vocabulary (built on first use:
    wrapping the tokenizer takes ~0.6 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 reasoning_parser: str | None = None):
        if reasoning_parser is not None and reasoning_parser not in REASONING_ENDS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_ENDS)}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._reasoning_parser = reasoning_parser

    @functools.cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer:
        try:
            return llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size,
                                                eos_token=self._eos_token_ids or None)
        except ValueError as error:
            raise ValueError(f"structured outputs need a fast (Rust) tokenizer with an EOS token: {error}") from None

    def new_state(self, params: StructuredOutputsParams, prompt_tail: str = "") -> GrammarState:
        """A fresh state at the start of the grammar; ValueError naming the field when it does not compile.
        `prompt_tail` (the prompt's last words) tells whether a reasoning model's reply starts by thinking."""
        field = f"structured_outputs.{params.kind}"
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field} is not a valid {_DESCRIPTIONS[params.kind]}: {_first_lines(matcher.get_error())}")
        parser = self._reasoning_parser
        after = REASONING_ENDS[parser] if parser is not None and reasoning_open(parser, prompt_tail) else None
        return GrammarState(matcher, (self._vocab_size + 31) // 32, self._lltokenizer, after)


_DESCRIPTIONS = {"json": "JSON schema (or uses a feature llguidance does not support)", "json_object": "grammar",
                 "regex": "regular expression", "choice": "choice list", "grammar": "Lark or GBNF grammar"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar document for the constraint params holds (ValueError for unreadable input)."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as error:
        raise ValueError(f"structured_outputs.grammar is not a valid Lark or GBNF grammar: {error}") from None


def _first_lines(message: str, count: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:count])
