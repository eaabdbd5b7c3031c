"""Admission limits: what one request may cost the server (sequences, characters), checked before any work."""
from __future__ import annotations

import dataclasses
from typing import Any

from server.api_errors import bad_request

# Bodies beyond this answer 413 before they are parsed (--max-request-body-bytes).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
MAX_TOOLS = 128  # OpenAI's own limit on `tools`; each one's parameters schema may become part of a grammar


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (its vocabulary entry's length is an upper bound:
    byte-level pieces spell each byte as one character, and a character takes at least one byte)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """Bounds that refuse a request (400) before it is tokenized, rendered or queued."""

    max_n: int  # completions per prompt
    max_sequences: int  # sequences one HTTP request may queue: prompts x n
    max_prompt_chars: int  # no longer text can fit in max_model_len tokens
    max_prompt_tokens: int  # token id lists (prompts, /detokenize): max_model_len
    max_tools: int = MAX_TOOLS

    @classmethod
    def resolve(cls, *, max_num_seqs: int, max_waiting_requests: int | None, max_model_len: int, tokenizer: Any,
                max_n: int | None = None, max_prompt_chars: int | None = None) -> AdmissionLimits:
        """Fill the defaults from the engine; a max_n beyond max_num_seqs is a configuration error."""
        if max_n is None:
            max_n = max_num_seqs
        if not 1 <= max_n <= max_num_seqs:
            raise ValueError(f"--max-n must be between 1 and --max-num-seqs ({max_num_seqs}), got {max_n}")
        if max_prompt_chars is None:
            max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        if max_prompt_chars < 1:
            raise ValueError(f"--max-prompt-chars must be >= 1, got {max_prompt_chars}")
        return cls(max_n=max_n, max_sequences=max_num_seqs + (max_waiting_requests or max_num_seqs),
                   max_prompt_chars=max_prompt_chars, max_prompt_tokens=max_model_len)

    def check_n(self, n: int, best_of: int | None) -> None:
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and not 1 <= value <= self.max_n:
                raise bad_request(f"{name} must be between 1 and {self.max_n} (the server's --max-n), got {value}",
                                  name)

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """One request's sequences must fit the running batch plus the waiting queue at once."""
        if num_prompts * n > self.max_sequences:
            raise bad_request(f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                              f"the server holds at most {self.max_sequences} at once (--max-num-seqs plus "
                              "--max-waiting-requests): split it into smaller requests", "prompt")

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"{param} has {num_chars} characters; at most {self.max_prompt_chars} can fit in "
                              "this model's context (--max-prompt-chars)", param)

    def check_tokens(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_prompt_tokens:
            raise bad_request(f"{param} has {num_tokens} tokens; at most {self.max_prompt_tokens} (the model's "
                              "context length) are accepted", param)

    def check_tools(self, num_tools: int) -> None:
        if num_tools > self.max_tools:
            raise bad_request(f"tools has {num_tools} functions; at most {self.max_tools} are allowed", "tools")
