"""Maps HF `architectures` names to jvllm model classes."""
from __future__ import annotations

from flax import nnx

from models.llama import LlamaForCausalLM

_CAUSAL_LMS: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_CAUSAL_LMS)


def model_class_for(architecture: str) -> type[nnx.Module]:
    """The class serving `architecture`, or a ValueError listing what is supported."""
    try:
        return _CAUSAL_LMS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
