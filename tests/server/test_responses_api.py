"""OpenAI's Responses API (/v1/responses) through the unmodified openai client and openai-agents' Runner."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest

from tests.server.conftest import API_KEY, MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
SHIRT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M"]}},
         "required": ["color", "size"], "additionalProperties": False}
# the forced choices; their tests pass parallel_tool_calls=False, as the tiny random model would go on
# adding calls
FORCED = [pytest.param("required", id="required"),
          pytest.param({"type": "function", "name": "get_weather"}, id="named")]


def _twin(offline_engine, messages: list[dict], max_tokens: int):
    from jvllm import SamplingParams

    return offline_engine.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens),
                               use_tqdm=False)[0].outputs[0]


def test_usage_reports_the_input_tokens_the_prefix_cache_gave(client):
    """As OpenAI's: input_tokens_details.cached_tokens in every usage, streamed or not (no server flag needed)."""
    question = "Spell the word 'cache' backwards, then name three animals that live in the sea."
    first = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=4)
    again = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=4)
    assert again.usage.input_tokens == first.usage.input_tokens
    # all but the prompt's last token, whose logits are computed again
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens - 1
    streamed = _events(client, input=question, temperature=0, max_output_tokens=4)
    done = streamed[-1].response.usage
    assert done.input_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens


def _events(client, **kwargs) -> list:
    events = list(client.responses.create(model=MODEL, stream=True, **kwargs))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def test_text_equals_the_offline_greedy_twin_and_instructions_reach_the_prompt(client, offline_engine):
    plain = client.responses.create(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=10)
    expected = _twin(offline_engine, [{"role": "user", "content": "Name a color."}], 10)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == MODEL
    assert plain.output_text == expected.text and plain.error is None
    assert plain.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    [message] = plain.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = plain.usage
    assert usage.output_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert plain.temperature == 0 and plain.max_output_tokens == 10 and plain.tools == []

    # longer than the template's own default system prompt, which the instructions replace
    instructions = "You are a terse assistant. Answer every question with exactly one lowercase English word."
    instructed = client.responses.create(model=MODEL, input="Name a color.", instructions=instructions,
                                         temperature=0, max_output_tokens=10)
    assert instructed.usage.input_tokens > usage.input_tokens and instructed.instructions == instructions
    assert instructed.output_text == _twin(offline_engine, [{"role": "system", "content": instructions},
                                                            {"role": "user", "content": "Name a color."}], 10).text


@pytest.mark.parametrize("text, max_output_tokens", [
    (None, 12), ({"format": {"type": "json_schema", "name": "shirt", "schema": SHIRT}}, 40),
], ids=["free", "json_schema"])
def test_streamed_deltas_equal_the_whole_text_with_events_in_order(client, text, max_output_tokens):
    kwargs = dict(input="Describe a shirt.", temperature=0, max_output_tokens=max_output_tokens,
                  **({"text": text} if text else {}))
    whole = client.responses.create(model=MODEL, **kwargs)
    events = _events(client, **kwargs)
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    ending = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", ending]
    message_id = events[2].item.id
    assert all(event.item_id == message_id for event in events[3:-2]) and events[-2].item.id == message_id
    assert events[-3].part.text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    if text:  # the schema's grammar ends the reply
        assert whole.status == "completed" and types[-1] == "response.completed"
        jsonschema.validate(json.loads(whole.output_text), SHIRT)


def test_max_output_tokens_cut_is_incomplete(client, offline_engine):
    expected = _twin(offline_engine, [{"role": "user", "content": "Tell me a story."}], 3)
    assert expected.finish_reason == "length"
    cut = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 3
    assert cut.output_text == expected.text


def test_previous_response_id_continues_the_conversation(client, offline_engine):
    first = client.responses.create(model=MODEL, input="Hello!", temperature=0, max_output_tokens=6)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, temperature=0,
                                     max_output_tokens=6)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.total_tokens
    conversation = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And then?"}]
    assert second.output_text == _twin(offline_engine, conversation, 6).text
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text


def test_unknown_or_unstored_response_ids_are_404(client):
    import openai

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_reasoning_parser_makes_the_reasoning_an_output_item(client, live_server, monkeypatch):
    """deepseek_r1: text before `</think>` is reasoning; the random model never closes the block, so all of it is."""
    kwargs = dict(input="Name a color.", temperature=0, max_output_tokens=10, reasoning={"effort": "low"})
    plain = client.responses.create(model=MODEL, **kwargs)
    monkeypatch.setattr(live_server.app.state.jvllm.settings, "reasoning_parser", "deepseek_r1")
    whole = client.responses.create(model=MODEL, **kwargs)
    [reasoning] = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "incomplete"
    assert reasoning.content[0].text == plain.output_text and whole.output_text == ""
    events = _events(client, **kwargs)
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == plain.output_text
    assert [event.type for event in events if "delta" not in event.type] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]


def test_an_error_after_the_stream_began_is_its_last_event(client, monkeypatch):
    import server.responses_stream
    from server.api_errors import APIError

    outputs = []

    def fail_on_the_second(output):
        """The second output, or the last if the stream merged the tokens into fewer (a busy machine)."""
        outputs.append(output)
        if len(outputs) == 2 or output.finished:
            raise APIError(400, "the output cannot follow its constraint", code="generation_failed")
        return output

    monkeypatch.setattr(server.responses_stream, "check_not_failed", fail_on_the_second)
    events = list(client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=8, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "error" and events[-1].code == "generation_failed"
    assert "cannot follow" in events[-1].message
    assert not any(event.type.startswith("response.completed") for event in events)
    monkeypatch.undo()
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens > 0


def test_the_store_forgets_the_least_recently_used():
    from server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a").response == {"id": "a"}  # read: now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None and len(store) == 2


@pytest.mark.parametrize("tool_choice", FORCED)
def test_forced_function_calls_validate_and_stream_argument_fragments(client, tool_choice):
    kwargs = dict(input=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                  max_output_tokens=120)
    whole = client.responses.create(model=MODEL, **kwargs)
    assert whole.status == "completed" and whole.output_text == ""
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    events = _events(client, **kwargs)
    added = [event for event in events if event.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.name == "get_weather" and added[0].item.arguments == ""
    fragments = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and "".join(fragments) == done.arguments == call.arguments
    assert all(event.item_id == added[0].item.id for event in events if "arguments" in event.type)
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments


def test_function_call_output_continues_a_tool_turn(client):
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=120)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees, sunny"}
    chained = client.responses.create(model=MODEL, input=[result], previous_response_id=first.id, tools=[WEATHER],
                                      tool_choice="none", temperature=0, max_output_tokens=4)
    assert chained.usage.input_tokens > first.usage.input_tokens
    # the same conversation sent whole, the model's call as a function_call item
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             result]
    whole = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", temperature=0,
                                    max_output_tokens=4)
    assert whole.usage.input_tokens == chained.usage.input_tokens and whole.output_text == chained.output_text


def test_openai_agents_runner_calls_the_tool_and_ends_with_typed_output(live_server, monkeypatch):
    """The default Agent loop: turn 1 forces a call (tool_choice required), the tool runs, turn 2 (tool choice
    reset to auto, so the shared server gets a parser for this test) writes the output type's JSON, which its
    grammar ends; the random model could not end free text."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)
    settings = live_server.app.state.jvllm.settings
    monkeypatch.setattr(settings, "enable_auto_tool_choice", True)
    monkeypatch.setattr(settings, "tool_call_parser", "hermes")
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    class Forecast(BaseModel):
        sky: Literal["sunny", "rainy"]

    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=live_server.v1, api_key=API_KEY,
                                                                        max_retries=0))
    agent = Agent(name="forecaster", instructions="Use the tool, then answer.", model=model, tools=[get_weather],
                  output_type=Forecast, model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                                     max_tokens=60, parallel_tool_calls=False))
    result = Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert len(cities) == 1 and cities[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, Forecast)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "Hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input.0.content.0"),
])
def test_bad_requests_are_400_in_openai_error_shape(client, server_errors, body, param):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, **body)
    error = refused.value.body
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or "").startswith(param), error
    assert not server_errors
