"""Default sampling parameters from the model's generation_config.json, as vLLM reads them: generation_config
'auto' / 'vllm' / a folder, override_generation_config, LLM.get_default_sampling_params and what generate() and the
server's requests run when they leave them out."""
import json
import shutil

import pytest

from jvllm import Engine, SamplingParams
from jvllm.model_loader.generation_defaults import generation_defaults
from server.protocol import ChatCompletionRequest
from server.sampling import sampling_params

HF_FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50,
           "repetition_penalty": 1.0, "max_new_tokens": 64}


def write_config(folder, config) -> None:
    (folder / "generation_config.json").write_text(json.dumps(config))


def test_the_file_gives_the_fields_that_differ_from_transformers_defaults(tmp_path):
    write_config(tmp_path, HF_FILE)
    # top_k 50 and repetition_penalty 1.0 are transformers' defaults: vLLM does not take them either
    assert generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert generation_defaults("vllm", tmp_path) == {}
    assert generation_defaults("auto", None) == {}
    assert generation_defaults("auto", tmp_path / "missing") == {}
    other = tmp_path / "other"
    other.mkdir()
    write_config(other, {"top_k": 20, "min_p": 0.05})
    assert generation_defaults(str(other), tmp_path) == {"top_k": 20, "min_p": 0.05}
    assert generation_defaults("auto", tmp_path, {"temperature": 0.2, "max_new_tokens": 8}) == {
        "temperature": 0.2, "top_p": 0.9, "max_tokens": 8}


def test_bad_sources_and_overrides_raise(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not read"):
        generation_defaults("auto", tmp_path)
    with pytest.raises(ValueError, match="unknown fields \\['do_sample'\\]"):
        generation_defaults("vllm", None, {"do_sample": False})


@pytest.fixture(scope="module")
def greedy_by_config(tiny_model_factory, tmp_path_factory):
    """The tiny llama with a generation config that makes sampling greedy (top_k 1) and short."""
    folder = tmp_path_factory.mktemp("tiny-llama-generation-config")
    shutil.copytree(tiny_model_factory("llama"), folder, dirs_exist_ok=True)
    write_config(folder, {"top_k": 1, "max_new_tokens": 6, "temperature": 0.8})
    return folder


def test_generate_without_params_runs_the_model_defaults(greedy_by_config):
    engine = Engine(model=str(greedy_by_config), max_model_len=256, kv_cache_memory_bytes=16 << 20,
                    precompile=False)
    defaults = engine.get_default_sampling_params()
    assert (defaults.top_k, defaults.max_tokens, defaults.temperature) == (1, 6, 0.8)
    prompts = ["The river", "Stone and light"]
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    default = engine.generate(prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in default] == [o.outputs[0].token_ids for o in greedy]
    plain = Engine(model=str(greedy_by_config), max_model_len=256, kv_cache_memory_bytes=16 << 20,
                   precompile=False, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    assert len(plain.generate("The river", use_tqdm=False)[0].outputs[0].token_ids) == 16  # SamplingParams' own


def test_an_invalid_default_is_refused_at_start(greedy_by_config):
    with pytest.raises(ValueError, match="generation config gives invalid sampling defaults: top_p"):
        Engine(model=str(greedy_by_config), precompile=False, override_generation_config={"top_p": 1.5})


def test_server_requests_take_the_defaults_for_what_they_leave_out():
    defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], top_k=5)
    params = sampling_params(body, max_tokens=8, logprobs=None, prompt_logprobs=None, defaults=defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p) == (0.6, 5, 1.1, 1.0)
    params = sampling_params(body, max_tokens=8, logprobs=None, prompt_logprobs=None)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (1.0, 5, 1.0)


def test_a_chat_request_without_options_runs_the_model_defaults(greedy_by_config):
    import httpx

    from tests.server.conftest import start_server

    server = start_server(greedy_by_config)
    try:
        messages = [{"role": "user", "content": "Name a river."}]
        replies = [httpx.post(f"{server.v1}/chat/completions", headers=server.headers, timeout=600,
                              json={"messages": messages, **extra}).json() for extra in ({}, {"temperature": 0})]
        # top_k 1 from the model's config: the same tokens as greedy; max_new_tokens 6 bounds both
        assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]
        assert replies[0]["usage"]["completion_tokens"] <= 6
        assert replies[0]["usage"]["completion_tokens"] == 6 or replies[0]["choices"][0]["finish_reason"] == "stop"
    finally:
        server.stop()
