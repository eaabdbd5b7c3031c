"""Chat messages with content parts (OpenAI's text and image_url, vLLM's image_pil) -> messages with string content
for the chat template, and the images in prompt order."""
from __future__ import annotations

from typing import Any, Callable

IMAGE_PART_TYPES = ("image_url", "image_pil")


def image_url_of(part: dict[str, Any]) -> str:
    """An image_url part's URL: {"image_url": {"url": ...}} (OpenAI) or {"image_url": "..."}."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError("an image_url content part needs image_url.url, a string")
    return url


def message_text(texts: list[str], num_images: int, image_token: str) -> str:
    """A message's string content as vLLM writes it for a string-content template: one placeholder per image,
    each on its own line, before the text parts (joined by newlines)."""
    return "\n".join([image_token] * num_images + texts)


def split_conversation(conversation: list[dict[str, Any]], image_token: str | None,
                       load_image: Callable[[str], Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """-> (messages whose list contents became strings, the images in order). `image_token` None (a text-only model)
    refuses image parts; `load_image(url)` loads an image_url part's image."""
    messages: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        texts: list[str] = []
        found: list[Any] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind in IMAGE_PART_TYPES:
                if image_token is None:
                    raise ValueError("this model is text-only: it takes no image content parts")
                found.append(load_image(image_url_of(part)) if kind == "image_url" else part.get("image_pil"))
            else:
                raise ValueError(f"unsupported content part type {kind!r}; supported: text, "
                                 f"{', '.join(IMAGE_PART_TYPES)}")
        messages.append({**message, "content": message_text(texts, len(found), image_token or "")})
        images += found
    return messages, images
