"""Per-architecture GGUF knowledge: the HF class each llama.cpp architecture becomes, its tensor names, config fields
and the weight changes llama.cpp's converter made (q/k row order, Gemma's norm offset) that loading undoes."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import gguf
import numpy as np

EXPERT = "{e}"  # in an HF name template: the GGUF tensor stacks every expert on axis 0, each its own HF tensor

# GGUF per-block tensor names -> HF names (suffix .weight/.bias kept), shared by every architecture below.
_COMMON_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_MIXTRAL_BLOCK = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
    "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2",
    "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
}
_QWEN_MOE_BLOCK = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Phi-3 keeps HF's fused tensors: q, k and v rows in attn_qkv, gate then up rows in ffn_up.
_PHI3_BLOCK = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma normalizes before and after each sublayer; ffn_norm is the norm before the MLP.
_GEMMA_BLOCK = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFHeader:
    """A GGUF file's metadata and tensor list, read once."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader
        self.arch: str = self.field("general.architecture")
        self.tensors = {t.name: t for t in reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value as plain Python (str/int/float/bool/list), or `default` when absent."""
        found = self.reader.fields.get(key)
        return default if found is None else found.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, e.g. arch_field('attention.head_count')."""
        return self.field(f"{self.arch}.{key}", default)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape in numpy order (torch's [out, in] for a projection), or None when absent."""
        tensor = self.tensors.get(name)
        return None if tensor is None else tuple(int(d) for d in reversed(tensor.shape))

    def num_layers(self) -> int:
        return int(self.arch_field("block_count"))


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture reads back as a Hugging Face checkpoint."""

    hf_class: str
    model_type: str
    block_names: dict[str, str]
    extra_config: Callable[[GGUFHeader], dict[str, Any]] = lambda header: {}  # fields beyond the common ones
    permuted_rope: bool = False  # the converter interleaved each q/k head's rotary halves (llama.cpp's llama rope)
    norm_offset: float = 0.0  # the converter stored every RMSNorm weight plus this (Gemma computes x * (1 + w))


def _experts_config(header: GGUFHeader, mixtral: bool, normalize_default: bool = True) -> dict[str, Any]:
    """Expert counts and sizes; layers without expert tensors are dense MLPs (`mlp_only_layers`)."""
    sparse = [i for i in range(header.num_layers()) if f"blk.{i}.ffn_gate_exps.weight" in header.tensors]
    experts_shape = header.shape(f"blk.{sparse[0]}.ffn_gate_exps.weight")  # [E, expert ff, hidden]
    count = int(header.arch_field("expert_count") or experts_shape[0])
    used = int(header.arch_field("expert_used_count"))
    if mixtral:
        return {"num_local_experts": count, "num_experts_per_tok": used, "intermediate_size": experts_shape[1]}
    shared = header.shape(f"blk.{sparse[0]}.ffn_gate_shexp.weight")  # [shared ff, hidden]
    return {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(header.arch_field("expert_feed_forward_length") or experts_shape[1]),
        "shared_expert_intermediate_size": int(header.arch_field("expert_shared_feed_forward_length")
                                               or (shared[0] if shared else 0)),
        "norm_topk_prob": bool(header.arch_field("expert_weights_norm", normalize_default)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(header.num_layers()) if i not in sparse],
    }


def _phi3_config(header: GGUFHeader) -> dict[str, Any]:
    """Phi-3's sliding window (0: none) and LongRoPE, whose per-frequency factors are stored as tensors."""
    config: dict[str, Any] = {}
    window = header.arch_field("attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    original = header.arch_field("rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in header.tensors:
        factors = {kind: [float(x) for x in np.asarray(header.tensors[f"rope_factors_{kind}.weight"].data).ravel()]
                   for kind in ("long", "short")}
        scaling = {"rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"]}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        attention_factor = header.arch_field("rope.scaling.attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
        config["rope_scaling"] = scaling
    return config


def _gemma_query_scalar(header: GGUFHeader, big_layer_count: int) -> int:
    """The attention scale's denominator, which GGUF does not store: llama.cpp uses hidden / heads for the 27B
    models (told apart by layer count) and head_dim otherwise, unless `attention.scale` is set."""
    scale = header.arch_field("attention.scale")
    if scale:
        return int(round(float(scale) ** -2))
    hidden, heads = int(header.arch_field("embedding_length")), int(header.arch_field("attention.head_count"))
    if header.num_layers() == big_layer_count:
        return hidden // heads
    return int(header.arch_field("attention.key_length") or hidden // heads)


def _gemma_config(header: GGUFHeader, gemma3: bool) -> dict[str, Any]:
    """Sliding window and which layers use it, soft-caps, Gemma 3's local RoPE base and the query scale."""
    config: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                              "query_pre_attn_scalar": _gemma_query_scalar(header, 62 if gemma3 else 46)}
    window = header.arch_field("attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    pattern = header.arch_field("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True where it attends within the window
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        config["sliding_window_pattern"] = int(pattern)
    final_cap = header.arch_field("final_logit_softcapping")
    if final_cap:
        config["final_logit_softcapping"] = float(final_cap)
    if gemma3:
        config["rope_local_base_freq"] = float(header.arch_field("rope.freq_base_swa", 10000.0))
    else:
        attn_cap = header.arch_field("attn_logit_softcapping")
        if attn_cap:
            config["attn_logit_softcapping"] = float(attn_cap)
    return config


_LLAMA = Architecture("LlamaForCausalLM", "llama", _COMMON_BLOCK, permuted_rope=True)
_MIXTRAL = Architecture("MixtralForCausalLM", "mixtral", {**_COMMON_BLOCK, **_MIXTRAL_BLOCK},
                        lambda h: _experts_config(h, mixtral=True), permuted_rope=True)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": _LLAMA,  # Mixtral too: llama.cpp stores it as llama with expert tensors
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", _COMMON_BLOCK),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", _COMMON_BLOCK),
    # llama.cpp renormalizes Qwen3-MoE's top-k routing weights and not Qwen2-MoE's
    "qwen2moe": Architecture("Qwen2MoeForCausalLM", "qwen2_moe", {**_COMMON_BLOCK, **_QWEN_MOE_BLOCK},
                             lambda h: _experts_config(h, mixtral=False, normalize_default=False)),
    "qwen3moe": Architecture("Qwen3MoeForCausalLM", "qwen3_moe", {**_COMMON_BLOCK, **_QWEN_MOE_BLOCK},
                             lambda h: _experts_config(h, mixtral=False, normalize_default=True)),
    "phi3": Architecture("Phi3ForCausalLM", "phi3", {**_COMMON_BLOCK, **_PHI3_BLOCK}, _phi3_config),
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", {**_COMMON_BLOCK, **_GEMMA_BLOCK},
                           lambda h: _gemma_config(h, gemma3=False), norm_offset=1.0),
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", {**_COMMON_BLOCK, **_GEMMA_BLOCK},
                           lambda h: _gemma_config(h, gemma3=True), norm_offset=1.0),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture_for(header: GGUFHeader) -> Architecture:
    """The Architecture of a GGUF file, or a ValueError listing the supported ones."""
    if header.arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {header.arch!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (llama includes Mixtral)")
    if header.arch == "llama" and any(name.endswith(".ffn_gate_exps.weight") for name in header.tensors):
        return _MIXTRAL
    return ARCHITECTURES[header.arch]


def hf_name(gguf_name: str, architecture: Architecture) -> str:
    """The HF name of a GGUF tensor; holds EXPERT where the tensor stacks every expert."""
    stem, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in architecture.block_names:
        return f"model.layers.{match.group(1)}.{architecture.block_names[match.group(2)]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a {architecture.model_type} GGUF file")


def split_experts(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """{HF name: tensor}: one per expert where `name` holds EXPERT (axis 0 of `array`), else `name` itself."""
    if EXPERT not in name:
        return {name: array}
    return {name.replace(EXPERT, str(e)): array[e] for e in range(array.shape[0])}


def fuse_phi3_attention(tensors: dict[str, np.ndarray]) -> None:
    """Phi-3 files with separate q/k/v tensors: concatenated into the qkv_proj rows the HF checkpoint holds."""
    for q_name in [n for n in tensors if n.endswith(".self_attn.q_proj.weight")]:
        prefix = q_name[: -len("q_proj.weight")]
        parts = [tensors.pop(prefix + f"{p}_proj.weight") for p in ("q", "k", "v")]
        tensors[prefix + "qkv_proj.weight"] = np.concatenate(parts, axis=0)
