"""use_beam_search on completions and chat through the openai client: n beams equal to the offline engine's
LLM.beam_search, streamed or not; what a beam search cannot honour is a 400."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL

BEAMS = dict(n=3, max_tokens=6, extra_body={"use_beam_search": True})


def offline_beams(offline_engine, prompt, **kwargs):
    from jvllm import BeamSearchParams

    (output,) = offline_engine.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6, **kwargs))
    tokenizer = offline_engine.get_tokenizer()
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str)
                     else prompt["prompt_token_ids"])
    return [(tokenizer.decode(s.tokens[prompt_len:], skip_special_tokens=True), s.finish_reason,
             len(s.tokens) - prompt_len) for s in output.sequences]


def test_completion_beams_equal_the_offline_search(client, offline_engine):
    result = client.completions.create(model=MODEL, prompt="The capital of France is", **BEAMS)
    tokenizer = offline_engine.get_tokenizer()
    expected = offline_beams(offline_engine, {"prompt_token_ids": tokenizer.encode("The capital of France is")})
    assert [(c.text, c.finish_reason) for c in result.choices] == [(text, reason) for text, reason, _ in expected]
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == sum(count for _, _, count in expected)
    streamed = list(client.completions.create(model=MODEL, prompt="The capital of France is", stream=True, **BEAMS))
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [text for text, _, _ in expected]


def test_chat_beams_equal_the_offline_search_and_carry_logprobs(client, offline_engine):
    messages = [{"role": "user", "content": "Name a color."}]
    result = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **BEAMS)
    prompt = offline_engine.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = offline_beams(offline_engine, prompt)
    assert [(c.message.content, c.finish_reason) for c in result.choices] == [(t, r) for t, r, _ in expected]
    for choice in result.choices:
        entries = choice.logprobs.content
        assert entries and all(len(entry.top_logprobs) == 2 for entry in entries)
        assert all(entry.logprob <= 0 for entry in entries)


@pytest.mark.parametrize("extra, param", [
    ({"n": 11}, "n"),
    ({"stop": ["."]}, "use_beam_search"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
])
def test_what_a_beam_search_cannot_honour_is_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                  extra_body={"n": 2, "use_beam_search": True, **extra})
    assert caught.value.body["param"] == param


def test_a_client_leaving_a_beam_search_stops_it(live_server, client):
    import json
    import socket
    import time

    import httpx

    from tests.server.conftest import API_KEY, idle, wait_until

    def finished() -> float:  # the beams' one-token requests end by length
        text = httpx.get(f"{live_server.url}/metrics").text
        name = 'jvllm:request_success_total{finished_reason="length"'
        line = next(x for x in text.splitlines() if x.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    engine = live_server.engine
    before = finished()
    body = json.dumps({"prompt": "A long search", "n": 3, "max_tokens": 400, "ignore_eos": True,
                       "use_beam_search": True}).encode()
    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: finished() >= before + 4, interval=0.01)  # into the search's second round
    assert wait_until(lambda: idle(engine)), engine.stats
    stopped_at = finished()
    time.sleep(1.0)  # no later round starts
    assert finished() == stopped_at < before + 3 * 400
    assert idle(engine), engine.stats
    engine.engine.pages.check_integrity()
    assert client.completions.create(model=MODEL, prompt="Still here", max_tokens=2).choices[0].text is not None
