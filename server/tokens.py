"""Per-token strings and bytes for logprobs, cached per token id."""
from __future__ import annotations

import json
from typing import Any


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE pieces back to raw bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


class TokenText:
    """How one token reads in logprobs: its decoded text, its exact bytes, or `token_id:N`."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None

    def text(self, token_id: int, decoded: str | None = None, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        if decoded is not None:
            return decoded
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a piece of a multi-byte character stays a piece, not U+FFFD)."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        raw = None
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in self._byte_decoder for ch in piece):
                raw = [self._byte_decoder[ch] for ch in piece]
        if raw is None:
            raw = list(self.text(token_id).encode("utf-8"))
        self._bytes[token_id] = raw
        return raw
