"""The official openai client against a live server: models, completions and chat, stream and not."""
from __future__ import annotations

import pytest

from tests.server.conftest import MODEL

GREEDY = dict(temperature=0, max_tokens=12)


def test_models_lists_every_served_name_with_max_model_len(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "jvllm"
    assert card.model_extra["max_model_len"] == 512
    assert client.models.retrieve("alias").id == "alias"


def test_completion_text_matches_the_offline_engine(client, offline_engine):
    from jvllm import SamplingParams

    expected = offline_engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12),
                                       use_tqdm=False)[0].outputs[0]
    result = client.completions.create(model=MODEL, prompt="The capital of France is", **GREEDY)
    assert result.object == "text_completion" and result.model == MODEL
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    usage = result.usage
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_completion_equals_the_non_streamed_one(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_alias_name_and_missing_model_both_serve_the_model(live_server):
    import httpx

    for body in ({"model": "alias"}, {}):
        reply = httpx.post(f"{live_server.v1}/completions", headers=live_server.headers,
                           json={"prompt": "Hi", "max_tokens": 2, **body})
        assert reply.status_code == 200
        assert reply.json()["model"] == MODEL  # responses name the first served name, as vLLM does


def test_chat_stream_starts_with_the_role_and_equals_the_non_streamed_reply(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_prompt_is_the_chat_template(client, live_server):
    import httpx

    messages = [{"role": "user", "content": "Hello there"}]
    tokenized = httpx.post(f"{live_server.url}/tokenize", headers=live_server.headers,
                           json={"messages": messages}).json()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == tokenized["count"]
    text = httpx.post(f"{live_server.url}/detokenize", headers=live_server.headers,
                      json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nHello there<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_include_usage_on_chat_streams(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **GREEDY))
    final = chunks[-1]
    assert final.choices == [] and all(c.usage is None for c in chunks[:-1])
    assert final.usage.completion_tokens == 12
    assert final.usage.total_tokens == final.usage.prompt_tokens + 12


def test_n_completions_and_several_prompts_get_their_own_indices(client):
    args = dict(model=MODEL, prompt=["One", "Two"], n=2, temperature=1.0, seed=5, max_tokens=4,
                extra_body={"ignore_eos": True})
    result = client.completions.create(**args)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.completion_tokens == 4 * 4
    streamed = list(client.completions.create(stream=True, **args))
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in result.choices}  # seeded: the same text streamed or not


def test_token_id_prompts_and_echo(client, live_server):
    import httpx

    ids = httpx.post(f"{live_server.url}/tokenize", headers=live_server.headers,
                     json={"prompt": "Echo this"}).json()["tokens"]
    plain = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt="Echo this", echo=True, **GREEDY)
    assert echoed.choices[0].text == "Echo this" + plain.choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt="Echo this", echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_stop_strings_end_the_text_before_the_stop(client):
    base = client.completions.create(model=MODEL, prompt="The sky", **GREEDY).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = client.completions.create(model=MODEL, prompt="The sky", stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == base[:base.index(stop)]
    chunks = list(client.completions.create(model=MODEL, prompt="The sky", stop=[stop], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == cut.text


def test_vllm_sampling_extras_are_accepted(client):
    result = client.completions.create(
        model=MODEL, prompt="Extras", max_tokens=5, temperature=0.8, seed=1,
        extra_body=dict(top_k=20, min_p=0.05, repetition_penalty=1.1, stop_token_ids=[2], ignore_eos=True,
                        min_tokens=5, skip_special_tokens=False, include_stop_str_in_output=False,
                        spaces_between_special_tokens=True, logit_bias={"5": 1.0}, allowed_token_ids=None))
    assert result.usage.completion_tokens == 5
    only = client.completions.create(model=MODEL, prompt="Extras", max_tokens=3, temperature=1.0,
                                     extra_body=dict(allowed_token_ids=[314], ignore_eos=True))
    assert only.choices[0].text == " is" * 3
    said = client.completions.create(model=MODEL, prompt="The capital of France is", **GREEDY).choices[0].text
    word = said.split()[0].strip(".,")
    avoided = client.completions.create(model=MODEL, prompt="The capital of France is", **GREEDY,
                                        extra_body=dict(bad_words=[word])).choices[0].text
    assert word in said and word not in avoided


# ---- logprobs: these depend on the engine filling CompletionOutput.logprobs / prompt_logprobs ----------
def test_completion_logprobs_have_tokens_offsets_and_top_alternatives(client):
    result = client.completions.create(model=MODEL, prompt="Logprobs please", logprobs=3, **GREEDY)
    choice = result.choices[0]
    lp = choice.logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely
    streamed = list(client.completions.create(model=MODEL, prompt="Logprobs please", logprobs=3, stream=True,
                                              **GREEDY))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_echo_with_logprobs_includes_the_prompt_tokens(client):
    result = client.completions.create(model=MODEL, prompt="Echo logprobs", echo=True, logprobs=1, max_tokens=2,
                                       temperature=0)
    lp = result.choices[0].logprobs
    prompt_tokens = result.usage.prompt_tokens
    assert len(lp.tokens) == prompt_tokens + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == result.choices[0].text


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs_only(client):
    # OpenAI's legacy completions and vLLM: how evaluation harnesses score a text's log-likelihood
    with_one = client.completions.create(model=MODEL, prompt="Score this text", echo=True, logprobs=1, max_tokens=1,
                                         temperature=0)
    result = client.completions.create(model=MODEL, prompt="Score this text", echo=True, logprobs=1, max_tokens=0)
    choice, prompt_tokens = result.choices[0], result.usage.prompt_tokens
    assert choice.text == "Score this text" and choice.finish_reason == "length"
    assert result.usage.completion_tokens == 0 and result.usage.total_tokens == prompt_tokens
    lp, expected = choice.logprobs, with_one.choices[0].logprobs
    assert len(lp.tokens) == prompt_tokens and "".join(lp.tokens) == choice.text
    assert lp.tokens == expected.tokens[:prompt_tokens]
    assert lp.token_logprobs == expected.token_logprobs[:prompt_tokens]
    assert lp.text_offset == expected.text_offset[:prompt_tokens]
    streamed = list(client.completions.create(model=MODEL, prompt="Score this text", echo=True, logprobs=1,
                                              max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert streamed[-1].choices[0].finish_reason == "length"
    with pytest.raises(Exception, match="max_tokens"):  # without echo, 0 tokens is no request
        client.completions.create(model=MODEL, prompt="Score this text", max_tokens=0)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, live_server):
    import httpx
    import openai

    ids = httpx.post(f"{live_server.url}/tokenize", headers=live_server.headers,
                     json={"prompt": "One two three four five six seven"}).json()["tokens"]
    kept_text = httpx.post(f"{live_server.url}/detokenize", headers=live_server.headers,
                           json={"tokens": ids[-3:]}).json()["prompt"]
    cut = client.completions.create(model=MODEL, prompt="One two three four five six seven", echo=True,
                                    extra_body={"truncate_prompt_tokens": 3}, **GREEDY)
    from_ids = client.completions.create(model=MODEL, prompt=ids[-3:], **GREEDY)
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == kept_text + from_ids.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}],
                                          extra_body={"truncate_prompt_tokens": 5}, **GREEDY)
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"truncate_prompt_tokens": 0}, **GREEDY)


def test_chat_logprobs_have_bytes_and_ranked_alternatives(client):
    messages = [{"role": "user", "content": "Logprobs in chat"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 12
    assert "".join(item.token for item in content) == reply.choices[0].message.content
    for item in content:
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token or "\ufffd" in item.token
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2,
                                                 stream=True, **GREEDY))
    streamed = [item.token for c in chunks if c.choices and c.choices[0].logprobs
                for item in c.choices[0].logprobs.content]
    assert streamed == [item.token for item in content]
