"""Incremental (streaming) detokenization with stop-string detection for one completion."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from jvllm.sampling_params import SamplingParams

# What a lossy UTF-8 decode yields for an incomplete multi-byte sequence.
_REPLACEMENT_CHAR = "\ufffd"

# Special-token id sets per tokenizer; computing them walks the whole added
# vocabulary, which is too slow to repeat for every request.
_SPECIAL_IDS_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops.

    Taken from the backend's added-token table (flag `special`), which is what
    the Rust decoder consults; transformers' `all_special_ids` only lists the
    named roles (bos/eos/...) and can miss extra special tokens.
    """
    try:
        return _SPECIAL_IDS_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = frozenset(int(tid) for tid, tok in decoder.items() if getattr(tok, "special", False))
    try:
        _SPECIAL_IDS_CACHE[tokenizer] = ids
    except TypeError:  # not weak-referenceable / hashable: just don't cache
        pass
    return ids


def _decoder(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, ...)` without cleaning up tokenization spaces.

    For transformers' fast tokenizers whose decode is the library's own, the
    Rust tokenizer is called directly: the same text (that decode only adds
    argument handling and the clean-up, which is off here), at a fraction of
    the cost of the Python wrapper, paid for every token of every request.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = "decode" not in vars(tokenizer) and _is_library_decode(type(tokenizer))
    if backend is not None and plain and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        # Honoured by tokenizers that implement it (Python/sentencepiece
        # backends); Rust-backed fast tokenizers ignore it, as in HF.
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )


@functools.lru_cache(maxsize=None)
def _is_library_decode(cls: type) -> bool:
    """Whether `cls` decodes with transformers' fast-tokenizer methods, unchanged by a subclass."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:  # transformers 5
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
    except ImportError:  # transformers 4
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as Fast
    return cls.decode is PreTrainedTokenizerBase.decode and cls._decode is Fast._decode


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one completion at a time.

    Uses the prefix/read-offset scheme: only a short window of tokens is decoded
    per step (`tokens[prefix:]` vs `tokens[prefix:read]`, the difference being
    the new text), and the window's first tokens give the decoder the context it
    needs (e.g. leading-space stripping). If the window's text ends in U+FFFD
    the last token(s) end in the middle of a UTF-8 sequence, so that text stays
    pending until later tokens complete it.

    Invariant: `text == tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)` up to stop-string truncation. Cleanup
    of tokenization spaces is always off because it rewrites text *before* the
    newest token (" ." -> "."), which cannot be streamed; vLLM does the same.
    The output is decoded on its own, like `tokenizer.decode(output_ids)`, so
    `prompt_token_ids` is kept for reference only, not used as decoding context.

    Only stop *strings* are handled here; stop token ids, EOS and max_tokens
    are the scheduler's business.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # A stream may only show text that no future stop match can remove. A
        # match ending in new text starts at most len(stop)-1 chars back, so that
        # many chars are held back. When the stop string is kept in the output,
        # a match never removes text, and nothing needs holding back (as vLLM).
        if self.stop and not self.include_stop_str_in_output:
            self._holdback = max(len(s) for s in self.stop) - 1
        else:
            self._holdback = 0
        # Skipped special tokens are left out of the decode window entirely:
        # decode() would drop them anyway, and keeping them could make a window
        # consist only of invisible tokens, losing the context described above.
        self._skip_ids = _special_token_ids(tokenizer) if self.skip_special_tokens else frozenset()
        self._decode_ids = _decoder(tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens)

        self._token_ids: list[int] = []  # every output token id, as given
        # Without stop strings no step needs the text, so ids are decoded only when it is read (a stream reads it
        # after every step; generate() once at the end): `_token_ids[_decoded:]` are not decoded yet.
        self._decoded = 0
        self._window_ids: list[int] = []  # the ids that decode() actually sees
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # committed text: complete characters only
        self._pending = ""  # decoded tail ending in an incomplete UTF-8 sequence
        self.stop_reason: str | None = None  # the stop string that matched

    # ------------------------------------------------------------------ state
    @property
    def text(self) -> str:
        """Full decoded text so far (truncated at the stop string once stopped).

        Includes a trailing incomplete character as U+FFFD, exactly as a full
        `tokenizer.decode` of the same ids would show it.
        """
        self._catch_up()
        return self._text + self._pending

    @property
    def token_ids(self) -> list[int]:
        """All output token ids added so far (including ones after a stop match)."""
        return self._token_ids

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def emittable_text(self, finished: bool) -> str:
        """Text safe to show a streaming client now.

        While running, holds back the last `max(len(stop)) - 1` characters (which
        could be the start of a stop string) and any incomplete character. Once
        finished, or once a stop string matched, the whole text is final.
        """
        self._catch_up()
        if finished or self.stop_reason is not None:
            return self.text
        end = len(self._text) - self._holdback
        return self._text[:end] if end > 0 else ""

    # --------------------------------------------------------------- decoding
    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _catch_up(self) -> str:
        """Decode the ids added since the last call; return the newly committed text (possibly empty)."""
        new_ids = self._token_ids[self._decoded :]
        self._decoded = len(self._token_ids)
        visible = [token_id for token_id in new_ids if token_id not in self._skip_ids]
        return self._advance(visible) if visible else ""

    def _advance(self, ids: list[int]) -> str:
        """Append visible ids to the window; return the newly committed text (possibly empty)."""
        window = self._window_ids + ids
        prefix_text = self._decode(window[self._prefix_offset : self._read_offset])
        new_text = self._decode(window[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR):
            if len(ids) > 1:
                # Some of the ids may end on a character boundary: commit what one id at a time would have.
                return "".join(self._advance([token_id]) for token_id in ids)
            # Incomplete UTF-8 at the end: keep it pending; `text` still shows it
            # so that a request finishing right here matches a full decode.
            self._window_ids = window
            self._pending = new_text[len(prefix_text) :]
            return ""
        self._window_ids = window
        self._pending = ""
        if len(new_text) <= len(prefix_text):
            # Tokens with no visible text yet: don't advance, so the window keeps
            # the earlier tokens as decoding context.
            return ""
        # The window ends on a character boundary: commit and slide the window.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window_ids)
        delta = new_text[len(prefix_text) :]
        self._text += delta
        return delta

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """Earliest stop-string match that ends after `search_from` (ties: list order)."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            # A match not entirely inside old text starts at most len(s)-1 back.
            idx = self._text.find(s, max(0, search_from - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append newly generated ids; return the stop string if one now matched.

        After a match the text is truncated at the stop string's start (or its
        end with include_stop_str_in_output) and further calls are no-ops
        apart from recording the ids.
        """
        self._token_ids.extend(token_ids)
        if self.stop_reason is not None:
            self._decoded = len(self._token_ids)  # ids after the match are recorded, never decoded
            return None
        if not self.stop:
            return None
        old_len = len(self._text)
        delta = self._catch_up()
        if not delta:
            return None
        match = self._find_stop(old_len)
        if match is None:
            return None
        idx, stop_str = match
        end = idx + len(stop_str) if self.include_stop_str_in_output else idx
        self._text = self._text[:end]
        self._pending = ""
        self.stop_reason = stop_str
        return stop_str
