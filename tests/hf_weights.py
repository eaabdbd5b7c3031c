"""Test helpers: tiny random transformers models whose weights are redrawn large enough that a wrong shard, head
order or bias moves the logits far above the tests' tolerances, and a tiny tokenizer made on the spot."""
from __future__ import annotations

import pathlib
import shutil


def redraw_weights(model, seed: int = 1) -> None:
    """Every parameter in place: std 0.2 noise, norms 1 +- 0.2 (biases +- 0.2 like any other weight)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.2 * torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + noise if "norm" in name else noise)


def save_random_model(config_cls, model_cls, settings: dict, folder: pathlib.Path, tokenizer_dir: pathlib.Path):
    """A model of `config_cls(**settings)` (seed 0, weights redrawn), saved into `folder` with the tokenizer files of
    `tokenizer_dir` that the model's own files do not replace; -> the model (eval mode)."""
    import torch

    torch.manual_seed(0)
    model = model_cls(config_cls(**settings)).eval()
    redraw_weights(model)
    model.save_pretrained(folder)
    for item in pathlib.Path(tokenizer_dir).iterdir():
        if item.is_file() and not (folder / item.name).exists():
            shutil.copy(item, folder / item.name)
    return model


def save_byte_level_tokenizer(folder: pathlib.Path, text: str) -> None:
    """A byte-level BPE tokenizer of ~300 tokens ("<eos>" first) trained on `text`, saved into `folder` as an HF
    tokenizer: tiny models without a download or another model's tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([text] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(folder)
