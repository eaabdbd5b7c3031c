"""Per-request sampling parameters with vLLM-compatible names, defaults and validation."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are numerically indistinguishable from argmax, and dividing logits by them
# overflows: they become 0 here, the one place that decides greedy (downstream, greedy is temperature == 0).
GREEDY_TEMPERATURE_EPS = 1e-5
# Same clamp as OpenAI/vLLM: beyond +-100 a bias already forces/forbids a token.
_MAX_ABS_LOGIT_BIAS = 100.0
# The sampler carries logit biases as a fixed [rows, MAX_LOGIT_BIAS_ENTRIES] list (static shapes).
MAX_LOGIT_BIAS_ENTRIES = 1024


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `n=True` is almost certainly a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    value = float(value)
    # NaN slips through every range comparison below, so reject it up front.
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN.")
    return value


def _as_token_id_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids (ints >= 0), got {value!r}.")
    for tid in value:
        if not _is_int(tid) or tid < 0:
            raise ValueError(f"{name} must contain only token ids (ints >= 0), got {tid!r}.")
    return list(value)


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """Constrains a request's output, as vLLM's: exactly one of a JSON schema (dict or JSON text), any JSON
    object, a regular expression, a choice of strings, or a grammar (Lark or GBNF/EBNF text)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar or json_object, "
                             f"got {given or 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}.")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string.")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name))


@dataclass(kw_only=True)
class SamplingParams:
    """Sampling parameters for one request; field meanings follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None  # words never generated (each word's last token blocked where it would end it)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: as many as leave room for one
    detokenize: bool = True  # False: token ids only (text stays "")

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}.")

        self.temperature = _as_float("temperature", self.temperature)
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature}.")
        self.top_p = _as_float("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or not (self.top_k in (0, -1) or self.top_k >= 1):
            raise ValueError(
                f"top_k must be an int: 0 or -1 (disabled) or >= 1, got {self.top_k!r}."
            )
        if self.top_k == -1:
            self.top_k = 0  # one spelling for "disabled" keeps the sampler simple
        self.min_p = _as_float("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be a finite float > 0, got {self.repetition_penalty}."
            )

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")

        self._normalize_stop()
        self.stop_token_ids = _as_token_id_list(
            "stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids
        )

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}."
            )

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}.")

        self._normalize_logit_bias()
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_token_id_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be non-empty when given (or None).")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")

        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens == -1
                                                                 or self.truncate_prompt_tokens >= 1)):
            raise ValueError("truncate_prompt_tokens must be None, -1 (up to the model's limit) or an int >= 1, got "
                             f"{self.truncate_prompt_tokens!r}.")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}.")
            self.bad_words = list(self.bad_words)
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}.")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are matched in the text); use stop_token_ids.")

        if self.temperature < GREEDY_TEMPERATURE_EPS:
            # Greedy: argmax is unaffected by truncation filters, so reset them to
            # neutral values; downstream code can then rely on temperature == 0.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _normalize_stop(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}.")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}.")
            if not s:
                # An empty stop string would match at position 0 and end every request.
                raise ValueError("stop must not contain empty strings.")
        self.stop = stop

    def _normalize_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> float, got {self.logit_bias!r}.")
        normalized: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            # JSON object keys are always strings, so "50256" must be accepted.
            if isinstance(key, str) and key.strip().isdigit():
                key = int(key.strip())
            if not _is_int(key) or key < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}.")
            if len(normalized) == MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                                 f"{len(self.logit_bias)}.")
            bias = _as_float(f"logit_bias[{key}]", value)
            normalized[key] = min(max(bias, -_MAX_ABS_LOGIT_BIAS), _MAX_ABS_LOGIT_BIAS)
        self.logit_bias = normalized

    @property
    def uses_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties apply (they read the whole token history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def clone(self) -> SamplingParams:
        """Independent copy: mutating lists/dicts of the clone leaves self untouched."""
        return copy.deepcopy(self)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if any token id in the params is outside [0, vocab_size)."""
        checks: list[tuple[str, list[int]]] = [("stop_token_ids", self.stop_token_ids)]
        if self.logit_bias:
            checks.append(("logit_bias", list(self.logit_bias)))
        if self.allowed_token_ids is not None:
            checks.append(("allowed_token_ids", self.allowed_token_ids))
        for name, ids in checks:
            bad = [tid for tid in ids if tid >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}."
                )
