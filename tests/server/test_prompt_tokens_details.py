"""--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens counts the prompt tokens the prefix
cache gave, on completions and chat, streamed or not; without the flag the field is null, as in vLLM."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, start_server

PROMPT = "A long shared opening that several requests repeat word for word. " * 8


@pytest.fixture(scope="module")
def details_client(tiny_llama):
    server = start_server(tiny_llama, settings={"enable_prompt_tokens_details": True})
    yield openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=600)
    server.stop()


def test_the_second_request_reports_the_cached_prompt_tokens(details_client):
    first = details_client.completions.create(model=MODEL, prompt=PROMPT + "First.", max_tokens=2)
    second = details_client.completions.create(model=MODEL, prompt=PROMPT + "Second.", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0  # whole KV pages of the shared opening
    assert cached <= second.usage.prompt_tokens - 1
    chunks = list(details_client.completions.create(model=MODEL, prompt=PROMPT + "Third.", max_tokens=2, stream=True,
                                                    stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_chat_reports_them_too(details_client):
    messages = [{"role": "user", "content": PROMPT}]
    details_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = details_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_without_the_flag_the_details_are_null(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert result.usage.prompt_tokens_details is None
