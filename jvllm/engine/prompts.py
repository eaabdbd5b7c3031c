"""Prompts to token ids: the accepted prompt forms, their checks, and chat conversations through the template."""
from __future__ import annotations

from typing import Any, Callable

from jvllm.multimodal.chat import split_conversation

PromptType = str | dict[str, Any]


def tokenize_prompt(tokenizer: Any, prompt: PromptType, vocab_size: int, max_model_len: int,
                    expand: Callable[[list[int]], list[int]] | None = None,
                    truncate_to: int | None = None) -> tuple[str | None, list[int]]:
    """-> (text if known, token ids); ValueError for a form it does not take, an empty prompt, ids outside the
    vocabulary, or a prompt that leaves no room for one generated token. `expand` rewrites the ids before the
    checks (image placeholders to their token counts). A dict prompt may carry `multi_modal_data`.
    `truncate_to` (SamplingParams.truncate_prompt_tokens) keeps the last that many ids, -1 as many as leave room
    for one generated token; a cut prompt's text is then that of the ids kept."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        text, token_ids = prompt["prompt"], tokenizer.encode(prompt["prompt"])
    else:
        raise ValueError("a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}; "
                         f"got {type(prompt).__name__}")
    if expand is not None:
        expanded = expand(list(token_ids))
        if truncate_to is not None and len(expanded) != len(token_ids):
            raise ValueError("truncate_prompt_tokens does not apply to prompts with images")
        token_ids = expanded
    kept = keep_last(token_ids, truncate_to, max_model_len - 1)
    if len(kept) < len(token_ids):
        text, token_ids = tokenizer.decode(kept), kept
    if not token_ids:
        raise ValueError("the prompt is empty: it must contain at least one token")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                         f"{max_model_len} (prompt plus at least one generated token must fit)")
    return text, token_ids


def keep_last(token_ids: list[int], truncate_to: int | None, room: int) -> list[int]:
    """The prompt's last `truncate_to` ids (SamplingParams.truncate_prompt_tokens; -1: the last `room`), or all of
    them when they are fewer or truncate_to is None."""
    keep = room if truncate_to == -1 else truncate_to
    return list(token_ids) if keep is None or len(token_ids) <= keep else list(token_ids)[-keep:]


# Arguments chat() sets itself: chat_template_kwargs may not pass them to the template.
RESERVED_TEMPLATE_ARGS = ("conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tools")


def template_arguments(add_generation_prompt: bool, continue_final_message: bool,
                       tools: list[dict[str, Any]] | None,
                       chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments for apply_chat_template, checked as vLLM's LLM.chat checks them; ValueError for a
    continuation with a generation prompt or a reserved name among chat_template_kwargs."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message=True continues the last (assistant) message, so it needs "
                         "add_generation_prompt=False")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(extra) & set(RESERVED_TEMPLATE_ARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: pass them as chat()'s own "
                         "arguments")
    if tools is not None:
        extra["tools"] = tools
    return {**extra, "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}


def chat_prompts(tokenizer: Any, conversations: list[list[dict[str, Any]]], *, chat_template: str | None,
                 add_generation_prompt: bool, continue_final_message: bool = False,
                 tools: list[dict[str, Any]] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each conversation rendered by the chat template, as {'prompt', 'prompt_token_ids'}. `tools` and
    `chat_template_kwargs` (e.g. {"enable_thinking": False}) reach the template as variables."""
    arguments = template_arguments(add_generation_prompt, continue_final_message, tools, chat_template_kwargs)
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False, **arguments)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template already has BOS if needed
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def conversation_prompts(tokenizer: Any, conversations: list[list[dict[str, Any]]], image_token: str | None,
                         load_image: Callable[[str], Any], **template: Any) -> list[dict[str, Any]]:
    """Conversations whose messages may hold content parts -> prompts: the template's text and ids, plus the images
    (in order) as multi_modal_data. `image_token` None (a text-only model) refuses image parts. `template`: the
    keyword arguments of chat_prompts."""
    split = [split_conversation(c, image_token, load_image) for c in conversations]
    prompts = chat_prompts(tokenizer, [messages for messages, _ in split], **template)
    for prompt, (_, images) in zip(prompts, split):
        if images:
            prompt["multi_modal_data"] = {"image": images}
    return prompts
