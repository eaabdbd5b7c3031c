"""Prefix-cache keys: each full page's key chains its parent page's key with the page's token ids and the images
its tokens hold (xxhash). A partial page (a tail) belongs to the key of the full pages before it and the cache
salt, and is told apart by its token ids."""
from __future__ import annotations

import struct

import xxhash

from jvllm.core.request import Request

_ROOT = 0  # the parent key of a sequence's first page


def chain_key(parent: int, token_ids: list[int], salt: bytes = b"") -> int:
    """64-bit key of one page: equal keys mean equal token prefixes (and salts), up to hash collisions."""
    payload = parent.to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}q", *token_ids) + salt
    return xxhash.xxh3_64_intdigest(payload)


def request_page_keys(request: Request, num_pages: int, page_size: int) -> list[int]:
    """Keys of the request's first `num_pages` full pages, extending the ones it already computed."""
    keys = request.page_keys
    salt = (request.cache_salt or "").encode()
    while len(keys) < num_pages:
        start = len(keys) * page_size
        tokens = request.tokens_between(start, start + page_size)
        keys.append(chain_key(keys[-1] if keys else _ROOT, tokens, salt + _images_in(request, start, page_size)))
    return keys[:num_pages]


def tail_owner(request: Request, full_pages: int, page_size: int) -> tuple[int, bytes]:
    """Whom a partial page after the request's first `full_pages` full pages belongs to: the last full page's key
    (which chains every token before it) and the cache salt."""
    keys = request_page_keys(request, full_pages, page_size)
    return (keys[-1] if keys else _ROOT, (request.cache_salt or "").encode())


def has_images_in(request: Request, start: int, length: int) -> bool:
    """Whether an image's placeholder tokens overlap tokens [start, start + length): such tails are not shared
    (their token ids do not tell the images apart)."""
    return any(item.offset < start + length and item.end > start for item in request.mm_items)


def _images_in(request: Request, start: int, page_size: int) -> bytes:
    """The hash and offset of every image whose placeholder tokens overlap the page: pages of the same token ids
    (image placeholders look alike) but different images never share a key."""
    spans = [(item.hash, item.offset) for item in request.mm_items
             if item.offset < start + page_size and item.end > start]
    return b"".join(struct.pack("<Qq", key, offset) for key, offset in spans)
