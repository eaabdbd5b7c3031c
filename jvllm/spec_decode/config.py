"""SpeculativeConfig: vLLM's `speculative_config` dictionary (methods "ngram", "suffix" and "draft_model"), checked
once at start."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# The engine speculates only while at most this many requests run: past it a CPU step is compute-bound and
# verifying drafts costs more than it saves (docs/design/speculative_decoding.md).
DEFAULT_MAX_BATCH = 4
# Suffix decoding's defaults: matches of up to 32 tokens (vLLM: 24) continued by up to 31 drafts, so that one
# request's verification step fills the 32-token step bucket; long copies are then accepted in fewer steps
# (docs/design/speculative_decoding.md, has the measurements).
SUFFIX_MAX_TREE_DEPTH = 32
SUFFIX_NUM_SPECULATIVE_TOKENS = 31
# ngram's tail length when neither prompt_lookup_min nor prompt_lookup_max is given (vLLM's default).
DEFAULT_PROMPT_LOOKUP = 5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many a step verifies per request.

    ngram: the tokens that followed the latest earlier occurrence of the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) in its prompt and output. suffix: the most frequent continuation of
    the longest suffix (3 to suffix_decoding_max_tree_depth tokens) found in the sequence and in the outputs of
    earlier requests; at most max_spec_factor x the match length tokens, stopping where the continuation's
    estimated probability drops below suffix_decoding_min_token_prob (a shorter suffix: while its continuation is
    near-certain, jvllm.spec_decode.suffix). draft_model: the greedy continuation of the sequence by `model`, a
    smaller model with the target's vocabulary, run by an engine of its own."""

    method: str
    num_speculative_tokens: int
    # vLLM's defaults: tails of exactly 5 tokens (one given alone sets the other; parse). Shorter tails propose
    # drafts the model mostly rejects on short structured answers (JSON), where verifying them costs more than it
    # saves (docs/design/speculative_decoding.md has the measurements).
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    suffix_decoding_max_tree_depth: int = SUFFIX_MAX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    max_batch_size: int = DEFAULT_MAX_BATCH  # speculate only while at most this many requests run
    model: str | None = None  # draft_model: its folder, .gguf file or known name

    def __post_init__(self) -> None:
        _check_method(self.method)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config needs a 'model' for method draft_model, and takes one only then")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config model must be a model name or path, got {self.model!r}")
        if not 0 < self.suffix_decoding_max_spec_factor:
            raise ValueError("speculative_config suffix_decoding_max_spec_factor must be positive")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config suffix_decoding_min_token_prob must be within [0, 1]")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A dict as vLLM takes it (or its JSON text). With only one of prompt_lookup_min/max given, the other takes
        its value, as in vLLM (neither: both 5)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method' ({', '.join(METHODS)})")
        fields = dict(value)
        _check_method(fields["method"])
        if fields["method"] == "suffix":
            fields.setdefault("num_speculative_tokens", SUFFIX_NUM_SPECULATIVE_TOKENS)
        if "num_speculative_tokens" not in fields:
            raise ValueError(f"speculative_config needs num_speculative_tokens for the {fields['method']} method")
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if low is None and high is not None:
            fields["prompt_lookup_min"] = high
        elif high is None and low is not None:
            fields["prompt_lookup_max"] = low
        return cls(**fields)


def _check_method(method: Any) -> None:
    """Raises ValueError naming the methods unless `method` is one of them."""
    if method not in METHODS:
        hint = (" (draft heads are not supported yet; a draft model is method 'draft_model')"
                if method in ("eagle", "eagle3", "medusa", "mtp") else "")
        raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {method!r}{hint}")
