"""Maps HF `architectures` names to jvllm model classes and their config readers."""
from __future__ import annotations

from typing import Any

from flax import nnx

from models.bert import BertForSequenceClassification, BertModel
from models.config import EncoderConfig, ModelConfig
from models.gemma import GemmaForCausalLM
from models.llama import LlamaForCausalLM
from models import llava, qwen2_5_vl, qwen2_vl

_CAUSAL_LMS: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}

# Encoders serve embeddings; task heads' weights (MLM, pooler) are ignored, the encoder is the same. Sequence
# classifiers (cross-encoders) keep their pooler and classifier and serve pair scores.
_ENCODERS: dict[str, type[nnx.Module]] = {
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
    "RobertaModel": BertModel,
    "RobertaForMaskedLM": BertModel,
    "XLMRobertaModel": BertModel,
    "XLMRobertaForMaskedLM": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": BertForSequenceClassification,
}

# Vision-language models -> their language model's config dict (one of the causal LMs above); the vision sides are
# models.llava's, models.qwen2_vl's and models.qwen2_5_vl's.
_VISION_LANGUAGE = {"LlavaForConditionalGeneration": llava.text_config_dict,
                    "Qwen2VLForConditionalGeneration": qwen2_vl.text_config_dict,
                    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl.text_config_dict}

_DEFAULT_ARCHITECTURE = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}


def supported_architectures() -> list[str]:
    return sorted([*_CAUSAL_LMS, *_ENCODERS, *_VISION_LANGUAGE])


def is_encoder_architecture(architecture: str) -> bool:
    return architecture in _ENCODERS


def model_class_for(architecture: str) -> type[nnx.Module]:
    """The class serving `architecture`, or a ValueError listing what is supported."""
    cls = _CAUSAL_LMS.get(architecture) or _ENCODERS.get(architecture)
    if cls is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return cls


def config_from_hf(hf: dict[str, Any]) -> ModelConfig | EncoderConfig:
    """Read an HF config.json dict into the config type its architecture needs (a vision-language model's: its
language model's)."""
    if not hf.get("architectures") and hf.get("model_type") in _DEFAULT_ARCHITECTURE:
        hf = {**hf, "architectures": [_DEFAULT_ARCHITECTURE[hf["model_type"]]]}
    architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if architecture in _VISION_LANGUAGE:  # the language model's config (a complete dict: see model_loader.vision)
        hf = _VISION_LANGUAGE[architecture](hf)
        architecture = hf["architectures"][0]
    model_class_for(architecture)  # unsupported architectures fail here, with the list
    if is_encoder_architecture(architecture):
        return EncoderConfig.from_hf_dict(hf)
    return ModelConfig.from_hf_dict(hf)
