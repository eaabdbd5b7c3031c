"""Tiny random checkpoints of every family the tensor-parallel tests shard, built once per test module."""
from __future__ import annotations

import pytest

from tests.hf_weights import save_random_model

# name -> (transformers kind, config overrides): GQA, MQA (1 KV head: replicated at TP=4), and Qwen2 with
# q/k/v biases, tied embeddings, a vocabulary (49155) and MLP width (100) that TP=2 / TP=3 must pad.
TINY = {
    "llama_gqa": ("llama", {}),
    "llama_mqa": ("llama", {"num_key_value_heads": 1}),
    "qwen2_padded": ("qwen2", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1,
                               "intermediate_size": 100, "vocab_size": 49155, "tie_word_embeddings": True}),
    # experts split along their intermediate width (40 and the shared expert's 50: padded at TP=3)
    "qwen2_moe_padded": ("qwen2_moe", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1,
                                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                                       "shared_expert_intermediate_size": 50, "norm_topk_prob": False}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # q/k/v and gate/up read as row ranges of fused tensors; the MLP width 101 is padded at TP=2
    "phi3_fused": ("phi3", {"intermediate_size": 101, "partial_rotary_factor": 0.5, "pad_token_id": 0}),
    # per-head q/k norms, and experts with dense layers mixed in
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 40, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # Mistral: every layer attends to the last 8 tokens only (the prompts are 9-16 long)
    "mistral_window": ("mistral", {"sliding_window": 8}),
    # sliding (8 tokens) and full layers, attention and final soft-caps, tied embeddings
    "gemma2": ("gemma2", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0, "pad_token_id": 0,
                          "tie_word_embeddings": True}),
    # q/k norms, two RoPE bases, one KV head replicated at TP=2
    "gemma3": ("gemma3", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8, "num_key_value_heads": 1,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                          "pad_token_id": 0}),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a tiny random HF model (weights std 0.2, norms 1 +- 0.2, biases +- 0.2, so that a
    wrong shard, head order or bias moves the logits far above the tolerance) with SmolLM2's tokenizer."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.loader import _gguf_as_hf_folder

    tokenizer_folder = _gguf_as_hf_folder(default_model_path())
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
               "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}
    folders = {}
    for name, (kind, overrides) in TINY.items():
        settings = {**dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           bos_token_id=1, eos_token_id=2, tie_word_embeddings=False), **overrides}
        folder = tmp_path_factory.mktemp(f"tp-{name}")
        save_random_model(*classes[kind], settings, folder, tokenizer_folder)
        folders[name] = str(folder)
    return folders
