"""LLM.chat's template options as vLLM spells them: chat_template_kwargs and tools reach the template,
continue_final_message goes on with the last message, and the combinations vLLM refuses raise ValueError."""
import pytest

from jvllm import SamplingParams

# Shows every variable the options set, so the rendered prompt says what reached the template.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or not continue_final_message %}"
            "</{{ m.role }}>{% endif %}{% endfor %}"
            "{% if tools %}[tools: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]"
            "{% endif %}{% if mood is defined %}(mood: {{ mood }}){% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def test_chat_template_kwargs_and_tools_reach_the_template(default_engine):
    (output,) = default_engine.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template=TEMPLATE,
                                    tools=[WEATHER_TOOL], chat_template_kwargs={"mood": "calm"}, use_tqdm=False)
    text = "<user>Hi</user>[tools: get_weather](mood: calm)<assistant>"
    assert output.prompt == text
    assert output.prompt_token_ids == default_engine.get_tokenizer().encode(text, add_special_tokens=False)
    assert len(output.outputs[0].token_ids) >= 1


def test_without_options_the_template_sees_none_of_them(default_engine):
    (output,) = default_engine.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template=TEMPLATE,
                                    use_tqdm=False)
    assert output.prompt == "<user>Hi</user><assistant>"


def test_continue_final_message_goes_on_with_the_assistant_message(default_engine):
    tokenizer = default_engine.get_tokenizer()
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is"}]
    (output,) = default_engine.chat(conversation, SamplingParams(temperature=0, max_tokens=8),
                                    add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    assert output.prompt == expected
    assert expected.endswith("The capital of France is")  # no end of turn after the partial message
    assert "Paris" in output.outputs[0].text
    (custom,) = default_engine.chat(conversation, GREEDY, chat_template=TEMPLATE, add_generation_prompt=False,
                                    continue_final_message=True, use_tqdm=False)
    assert custom.prompt == ("<user>What is the capital of France?</user>"
                             "<assistant>The capital of France is")


def test_refused_combinations(default_engine):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        default_engine.chat(conversation, GREEDY, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt"):
        default_engine.chat(conversation, GREEDY, chat_template_kwargs={"add_generation_prompt": False},
                            use_tqdm=False)
    with pytest.raises(ValueError, match="may not set tools"):
        default_engine.chat(conversation, GREEDY, chat_template_kwargs={"tools": [WEATHER_TOOL]}, use_tqdm=False)
