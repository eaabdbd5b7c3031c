"""Prompts to token ids: the accepted prompt forms, their checks, and chat conversations through the template."""
from __future__ import annotations

from typing import Any

PromptType = str | dict[str, Any]


def tokenize_prompt(tokenizer: Any, prompt: PromptType, vocab_size: int,
                    max_model_len: int) -> tuple[str | None, list[int]]:
    """-> (text if known, token ids); ValueError for a form it does not take, an empty prompt, ids outside the
    vocabulary, or a prompt that leaves no room for one generated token."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        text, token_ids = prompt["prompt"], tokenizer.encode(prompt["prompt"])
    else:
        raise ValueError("a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}; "
                         f"got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty: it must contain at least one token")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                         f"{max_model_len} (prompt plus at least one generated token must fit)")
    return text, token_ids


def chat_prompts(tokenizer: Any, conversations: list[list[dict[str, Any]]], *, chat_template: str | None,
                 add_generation_prompt: bool) -> list[dict[str, Any]]:
    """Each conversation rendered by the chat template, as {'prompt', 'prompt_token_ids'}."""
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template already has BOS if needed
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts
