"""Parity with transformers (PyTorch, float32) for the families beyond Llama: Qwen3 (per-head q/k norms), Phi-3
(fused qkv and gate/up tensors, partial rotary, LongRoPE), Gemma 2 and 3 (sandwich norms, soft-caps, interleaved sliding
windows, two RoPE bases; prompts run past the window) and the mixtures of experts Mixtral, Qwen3-MoE (dense layers mixed in through `mlp_only_layers`) and Qwen2-MoE (a
sigmoid-gated shared expert, a MoE layer every second layer, routing weights not renormalised).

Each tiny random config is built with transformers' config class and saved with `save_pretrained`; its weights
are redrawn large (std 0.2, norms 1 +- 0.2) as in test_llama_parity; the experts' loads come out uneven (checked:
the ragged groups differ in size). Checked: the logits of every prompt position, batched greedy generation
through the paged decode path over 32 tokens, and the same tokens with chunked prefill and prefix-cache hits."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jvllm import Engine, SamplingParams  # noqa: E402
from tests.hf_weights import save_random_model  # noqa: E402
from tests.models.test_llama_parity import (  # noqa: E402
    GENERATION_TEXTS, LOGITS_TEXT, _assert_greedy_match, _hf_greedy, assert_prompt_logits_match)

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # fused qkv and gate/up tensors; RoPE on half of each head
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    # LongRoPE within the original context (96 tokens, jvllm's ceiling for max_model_len): the short factors and
    # the attention temperature of max_position_embeddings / original
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(pad_token_id=0, max_position_embeddings=256, original_max_position_embeddings=96,
                           rope_scaling={"rope_type": "longrope",
                                         "short_factor": [1.0, 1.1, 1.2, 1.0, 1.3, 1.5, 1.1, 1.0],
                                         "long_factor": [1.0, 2.0, 3.5, 5.0, 8.0, 12.0, 16.0, 20.0]})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2, num_hidden_layers=3)),
    # sliding (8 tokens), full, sliding layers; attention and final soft-caps small enough to bite; a query
    # scale that is not head_dim's
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                    attn_logit_softcapping=4.0, final_logit_softcapping=6.0, pad_token_id=0)),
    # two sliding layers with the local RoPE base, then a full layer with the global base and linear scaling;
    # q/k norms
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def _router_names(model) -> list[str]:
    return [name for name, _ in model.named_modules() if name.endswith((".mlp.gate", ".block_sparse_moe.gate"))]


@pytest.fixture(scope="module")
def family_models(smollm_tokenizer_dir, tmp_path_factory):
    """name -> (folder, transformers model), built on first use."""
    built: dict[str, tuple[pathlib.Path, object]] = {}

    def get(name: str):
        if name not in built:
            config_name, model_name, overrides = FAMILIES[name]
            folder = tmp_path_factory.mktemp(f"family-{name}")
            model = save_random_model(getattr(transformers, config_name), getattr(transformers, model_name),
                                      {**BASE, **overrides}, folder, smollm_tokenizer_dir)
            built[name] = (folder, model)
        return built[name]

    return get


def _engine(folder: pathlib.Path, **overrides) -> Engine:
    # precompile=False: these tests check numbers; tests/jvllm/test_no_compile.py checks the closed shape set.
    return Engine(str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20, precompile=False, **overrides)


def _expert_loads(model, ids: list[int]) -> list[np.ndarray]:
    """Per MoE layer, how many of the prompt's token choices each expert received (transformers' routing)."""
    loads: list[np.ndarray] = []
    top_k = model.config.num_experts_per_tok

    def record(_module, _inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        chosen = torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices.reshape(-1)
        loads.append(np.bincount(chosen.numpy(), minlength=logits.shape[-1]))

    hooks = [model.get_submodule(name).register_forward_hook(record) for name in _router_names(model)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return loads


@pytest.mark.parametrize("backend", ["cpu", pytest.param("xla", marks=pytest.mark.extended)])  # cpu: the default
@pytest.mark.parametrize("name", list(FAMILIES))
def test_prompt_logits_match_transformers(name, backend, family_models, default_engine):
    """On the native kernel (the CPU default) and on the plain-jnp backend (its fallback); the Pallas kernels have
    their own test below, decode steps the generation test."""
    folder, hf_model = family_models(name)
    ids = default_engine.get_tokenizer().encode(LOGITS_TEXT)[:40]
    engine = _engine(folder, attention_backend=backend)
    assert engine.runner.backend.name == backend
    assert_prompt_logits_match(engine, hf_model, ids)
    if _router_names(hf_model):
        loads = _expert_loads(hf_model, ids)
        assert loads, "no router ran"
        for load in loads:  # every expert used, the busiest by far more than the least used
            assert load.sum() == 2 * len(ids) and load.min() >= 1 and load.max() >= 1.5 * load.min(), load


# Decoding, chunking and caching differ by family where the attention or the experts do: windows (gemma2, gemma3),
# longrope (phi3_longrope), experts (qwen3_moe). The others' layers are the prompt-logits test's; the extended run
# decodes them too.
DECODE_FAMILIES = ("gemma2", "gemma3", "phi3_longrope", "qwen3_moe")


@pytest.mark.parametrize("name", [name if name in DECODE_FAMILIES else pytest.param(name, marks=pytest.mark.extended)
                                  for name in FAMILIES])
def test_greedy_generation_matches_transformers_chunked_and_cached(name, family_models, default_engine):
    folder, hf_model = family_models(name)
    tokenizer = default_engine.get_tokenizer()
    # 5, 17 and 37 prompt tokens: page boundaries (16) fall inside prompts and inside generation.
    prompts = [tokenizer.encode(GENERATION_TEXTS[i])[:n] for i, n in ((0, 5), (2, 17), (7, 37))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    outputs = _engine(folder).generate(requests, params, use_tqdm=False)
    for index, (ids, output) in enumerate(zip(prompts, outputs)):
        want, ref_logits = _hf_greedy(hf_model, ids, 32)
        _assert_greedy_match(output.outputs[0].token_ids, want, ref_logits, f"{name} prompt {index}")
    # 16-token chunks split the longer prompts; the second pass reads the first pass's full pages from the cache
    chunked = _engine(folder, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    first = chunked.generate(requests, params, use_tqdm=False)
    second = chunked.generate(requests, params, use_tqdm=False)
    assert sum(o.num_cached_tokens or 0 for o in second) >= 16 + 32
    for plain, once, again in zip(outputs, first, second):
        assert once.outputs[0].token_ids == again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_moe_config_reads_routing_settings(family_models):
    from models.config import ModelConfig
    import json

    for name, normalized, sparse, shared in (("mixtral", True, (True, True), 0),
                                             ("qwen3_moe", True, (True, False), 0),
                                             ("qwen2_moe", False, (False, True, False), 48)):
        folder, _ = family_models(name)
        moe = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text())).moe
        assert (moe.num_experts, moe.top_k) == (4, 2)
        assert (moe.normalize_top_k, moe.sparse_layers, moe.shared_intermediate_size) == (normalized, sparse, shared)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# The kernels' features: partial rotary (phi3), sliding window and soft cap (gemma2); the rest is the same kernel.
@pytest.mark.parametrize("name", [name if name in ("phi3", "gemma2") else pytest.param(name, marks=pytest.mark.extended)
                                  for name in FAMILIES])
def test_pallas_backend_matches_transformers(name, family_models, default_engine, monkeypatch):
    """The Pallas kernels (interpret mode on CPU): each prompt token's logprob through the ragged kernel, then
    greedy tokens and their logprobs through the decode kernel, past a page boundary and (Gemma) the sliding
    window, against transformers' log-softmax."""
    monkeypatch.delenv("JVLLM_PALLAS_INTERPRET", raising=False)
    folder, hf_model = family_models(name)
    engine = _engine(folder, attention_backend="pallas", max_model_len=64, max_num_seqs=2)
    assert engine.runner.backend.name == "pallas"
    ids = default_engine.get_tokenizer().encode(LOGITS_TEXT)[:20]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    [output] = engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    with torch.no_grad():
        prompt_ref = _log_softmax(hf_model(torch.tensor([ids])).logits[0].float().numpy())  # [n, V]
    got_prompt = [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    want_prompt = [prompt_ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(got_prompt, want_prompt, rtol=0, atol=1e-4)
    want, ref_logits = _hf_greedy(hf_model, ids, 16)
    got = output.outputs[0].token_ids
    _assert_greedy_match(got, want, ref_logits, f"{name} on pallas")
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
    got_logprobs = [output.outputs[0].logprobs[i][got[i]].logprob for i in range(agree)]
    want_logprobs = [_log_softmax(ref_logits[i])[got[i]] for i in range(agree)]
    np.testing.assert_allclose(got_logprobs, want_logprobs, rtol=0, atol=1e-4)


def test_longrope_max_model_len_stops_at_the_original_context(family_models):
    folder, _ = family_models("phi3_longrope")
    assert _engine(folder).config.max_model_len == 96  # the default: the original context, not 256
    with pytest.raises(ValueError, match="original context.*max_model_len <= 96"):
        _engine(folder, max_model_len=128)
