"""Tiny random LLaVA-1.5 models saved with transformers (CLIP tower + projector + Llama), their tokenizer (SmolLM2's
with an `<image>` token) and CLIP image processor, and the transformers oracle for them."""
from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def llava_tokenizer():
    """SmolLM2's tokenizer (rebuilt from the default model's GGUF, no engine needed) plus `<image>` (id 49152)."""
    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.gguf import gguf_tokenizer

    tokenizer = gguf_tokenizer(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tokenizer.convert_tokens_to_ids("<image>") == 49152
    return tokenizer


@pytest.fixture(scope="session")
def make_llava(llava_tokenizer, tmp_path_factory):
    """make(name, **overrides) -> (folder, transformers model): a tiny random LLaVA saved with save_pretrained."""
    from tests.multimodal.helpers import build_llava

    made: dict[str, tuple[pathlib.Path, object]] = {}

    def make(name: str = "base", **overrides):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"llava-{name}")
            made[name] = (folder, build_llava(folder, llava_tokenizer, **overrides))
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_llava(make_llava):
    return make_llava("base")


@pytest.fixture(scope="session")
def tiny_text_llama(llava_tokenizer, tmp_path_factory) -> pathlib.Path:
    """A text-only tiny Llama with the same tokenizer (for the 'image given to a text-only model' errors)."""
    import torch
    import transformers

    from tests.multimodal.helpers import TEXT

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT)).eval()
    folder = tmp_path_factory.mktemp("text-llama")
    model.save_pretrained(folder)
    llava_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def images():
    """Six random RGB images of different sizes (the processor resizes and crops each to 28 x 28)."""
    from tests.multimodal.helpers import random_image

    sizes = [(40, 60), (28, 28), (90, 30), (64, 64), (33, 50), (120, 80)]
    return [random_image(seed, size) for seed, size in enumerate(sizes)]


@pytest.fixture(scope="session")
def qwen2_vl_tok():
    from tests.multimodal.qwen2_vl_helpers import qwen2_vl_tokenizer

    return qwen2_vl_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen2_vl(qwen2_vl_tok, tmp_path_factory):
    """(folder, transformers model): a tiny random Qwen2-VL saved with save_pretrained."""
    from tests.multimodal.qwen2_vl_helpers import build_qwen2_vl

    folder = tmp_path_factory.mktemp("qwen2-vl")
    return folder, build_qwen2_vl(folder, qwen2_vl_tok)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(qwen2_vl_tok, tmp_path_factory):
    """(folder, transformers model): a tiny random Qwen2.5-VL (window attention in its vision tower)."""
    from tests.multimodal.qwen2_vl_helpers import build_qwen2_5_vl

    folder = tmp_path_factory.mktemp("qwen2.5-vl")
    return folder, build_qwen2_5_vl(folder, qwen2_vl_tok)


def _qwen_oracle(folder, model, tokenizer):
    """(text, images) -> transformers' greedy ids and logits for it (32 new tokens), memoized."""
    from tests.multimodal.helpers import greedy_oracle
    from tests.multimodal.qwen2_vl_helpers import MAX_TOKENS, qwen2_vl_hf_processor

    return greedy_oracle(model, qwen2_vl_hf_processor(folder, tokenizer), MAX_TOKENS)


@pytest.fixture(scope="session")
def qwen2_vl_oracle(tiny_qwen2_vl, qwen2_vl_tok):
    return _qwen_oracle(*tiny_qwen2_vl, qwen2_vl_tok)


@pytest.fixture(scope="session")
def qwen2_5_vl_oracle(tiny_qwen2_5_vl, qwen2_vl_tok):
    return _qwen_oracle(*tiny_qwen2_5_vl, qwen2_vl_tok)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def qwen_vl(request):
    """(folder, transformers model, oracle) of each Qwen-VL family's tiny model."""
    folder, model = request.getfixturevalue(f"tiny_{request.param}")
    return folder, model, request.getfixturevalue(f"{request.param}_oracle")
