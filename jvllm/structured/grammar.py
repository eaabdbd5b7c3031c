"""Grammars for structured outputs: compiled by llguidance, advanced on the host, read as packed token bitmasks."""
from __future__ import annotations

import collections
import copy
import functools
import json
import threading
from typing import Any, Sequence

import llguidance
import numpy as np

from jvllm.sampling_params import StructuredOutputsParams
from jvllm.structured.reasoning import REASONING_ENDS, reasoning_open
from jvllm.structured.limits import GrammarLimits, check_constraint, constraint_value, plain_error
from jvllm.structured.sandbox import CompileAborted, GrammarSandbox, run_with_deep_stack

COMPILED_CACHE_SIZE = 64  # constraints kept compiled: an application tends to send the same schema again


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
        """Why the grammar cannot go on (a parser limit met, a token it refused), in plain words; else None."""
        return plain_error(self._matcher.get_error()) if self._matcher.is_error() else None

    def copy(self) -> GrammarState:
        state = GrammarState(self._matcher.deep_copy(), self._num_words, self._tokenizer)
        state._after, state._reasoning = self._after, self._reasoning
        return state


class GrammarCompiler:
    """Turns StructuredOutputsParams into grammar states for one tokenizer and vocabulary. Each new constraint is
    checked against GrammarLimits, compiled in the sandbox process, then here on the deep-stack thread; compiled
    constraints are kept (least recently used out) and copied for each request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 reasoning_parser: str | None = None, limits: GrammarLimits | None = None):
        if reasoning_parser is not None and reasoning_parser not in REASONING_ENDS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_ENDS)}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._reasoning_parser = reasoning_parser
        self.limits = limits or GrammarLimits()
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher | str] = collections.OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def _tokenizer_json(self) -> str:
        """The fast tokenizer serialised without padding or truncation, as llguidance reads it."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured outputs need a fast (Rust) tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    @functools.cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use: wrapping the tokenizer takes ~0.6 s."""
        try:
            return llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                          eos_token=self._eos_token_ids or None)
        except ValueError as error:
            raise ValueError(f"structured outputs need a fast (Rust) tokenizer with an EOS token: {error}") from None

    @functools.cached_property
    def sandbox(self) -> GrammarSandbox:
        return GrammarSandbox(self._tokenizer_json, self._vocab_size, self._eos_token_ids, self.limits)

    def new_state(self, params: StructuredOutputsParams, prompt_tail: str = "") -> GrammarState:
        """A fresh state at the start of the grammar; ValueError naming the field when it is over a limit or does
        not compile. `prompt_tail` (the prompt's last words) tells whether a reasoning model's reply starts by
        thinking."""
        matcher = self.compiled(params)
        with self._lock:
            matcher = matcher.deep_copy()
        parser = self._reasoning_parser
        after = REASONING_ENDS[parser] if parser is not None and reasoning_open(parser, prompt_tail) else None
        return GrammarState(matcher, (self._vocab_size + 31) // 32, self._lltokenizer, after)

    def compiled(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's matcher at its start (shared: copy it before use); ValueError as new_state."""
        kind, value = params.kind, constraint_value(params)
        check_constraint(kind, value, self.limits)
        key = kind + "\0" + json.dumps(value, sort_keys=True)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
        if isinstance(found, str):
            raise ValueError(found)
        if found is not None:
            return found
        try:
            matcher = self._compile(kind, value)
        except ValueError as error:
            self._remember(key, str(error))
            raise
        self._remember(key, matcher)
        return matcher

    def _compile(self, kind: str, value: Any) -> llguidance.LLMatcher:
        field = f"structured_outputs.{kind}"
        try:
            text = self.sandbox.compile(kind, value)
        except CompileAborted as error:
            raise ValueError(f"{field} could not be compiled: {error}; simplify it") from None
        except ValueError as error:
            raise ValueError(f"{field} is not a valid {_DESCRIPTIONS[kind]}: {plain_error(str(error))}") from None
        lltokenizer, parser_limits = self._lltokenizer, self.limits.parser_limits()

        def build() -> llguidance.LLMatcher:
            return llguidance.LLMatcher(lltokenizer, text, log_level=0, limits=parser_limits)

        matcher = run_with_deep_stack(build)
        if matcher.is_error():
            raise ValueError(f"{field} is not a valid {_DESCRIPTIONS[kind]}: {plain_error(matcher.get_error())}")
        return matcher

    def _remember(self, key: str, entry: llguidance.LLMatcher | str) -> None:
        with self._lock:
            self._compiled[key] = entry
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)

    def close(self) -> None:
        """Stop the sandbox process, if one was started."""
        if "sandbox" in self.__dict__:
            self.sandbox.close()


_DESCRIPTIONS = {"json": "JSON schema (or uses a feature llguidance does not support)", "json_object": "grammar",
                 "regex": "regular expression", "choice": "choice list", "grammar": "Lark or GBNF grammar"}
