"""Architecture descriptions read from HF config.json dicts: causal decoders (ModelConfig) and encoders (EncoderConfig)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: each token's top-k experts by router softmax, their outputs weighted."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    normalize_top_k: bool  # the k routing weights rescaled to sum to 1 (Mixtral, Qwen3-MoE) or kept (Qwen2-MoE)
    sparse_layers: tuple[bool, ...]  # per layer: whether its MLP is the mixture (else a dense MLP)
    shared_intermediate_size: int = 0  # a shared expert every token takes, sigmoid-gated (Qwen2-MoE); 0: none

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], num_layers: int) -> "MoEConfig | None":
        num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        if num_experts == 0:
            return None
        mixtral = hf.get("model_type") == "mixtral" or "moe_intermediate_size" not in hf
        step = int(hf.get("decoder_sparse_step") or 1)
        dense_layers = set(hf.get("mlp_only_layers") or ())
        return cls(
            num_experts=num_experts,
            top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=int(hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"]),
            normalize_top_k=True if mixtral else bool(hf.get("norm_topk_prob", False)),
            sparse_layers=tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers)),
            shared_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the Flax model needs to know; built from an HF config dict (or a GGUF header)."""

    is_encoder = False  # a causal decoder: generates, and embeds only with an explicit pooling choice

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # frozen dict items, hashable for jit
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # keys older than this many positions are not attended (Mistral)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    moe: MoEConfig | None = None  # the MLP is a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)
    fused_projections: bool = False  # HF stores qkv_proj and gate_up_proj as one tensor each (Phi-3)
    rotary_dim: int | None = None  # leading dims of each head that RoPE rotates (partial_rotary_factor); None: all
    # Gemma 2/3: which layers attend within `sliding_window` (None: all layers, when it is set), their own RoPE
    # base (Gemma 3's local layers, unscaled), the attention scale's denominator, and the tanh soft-caps.
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Multimodal RoPE (Qwen2-VL): positions arrive as [3, T] (temporal, height, width) and these counts of the
    # head's frequencies turn with each; None: plain positions [T].
    mrope_section: tuple[int, ...] | None = None

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index`, or None where it attends to the whole context."""
        if self.sliding_layers is not None and not self.sliding_layers[index]:
            return None
        return self.sliding_window

    @property
    def longest_supported_context(self) -> int:
        """max_model_len's ceiling. LongRoPE models stop at their original context: past it transformers rotates a
        whole sequence with the long factors (recomputing its cache when it crosses), which jvllm does not do."""
        scaling = self.rope_scaling_dict
        if scaling and scaling["rope_type"] == "longrope":
            return min(self.max_position_embeddings, int(scaling["original_max_position_embeddings"]))
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        architectures = hf.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope_settings(hf)
        model_type = hf.get("model_type", "")
        is_qwen2 = model_type in ("qwen2", "qwen2_moe") or architecture.startswith("Qwen2")
        num_layers = int(hf["num_hidden_layers"])
        llama_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope_scaling.items()))
            if rope_scaling else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or llama_bias,
            o_bias=llama_bias and not is_qwen2,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            sliding_window=_sliding_window(hf, is_qwen2 or model_type.startswith("qwen3")),
            qk_norm=model_type.startswith(("qwen3", "gemma3")) or architecture.startswith(("Qwen3", "Gemma3")),
            fused_projections=architecture.startswith("Phi3"),
            rotary_dim=_rotary_dim(hf, int(head_dim)),
            moe=MoEConfig.from_hf_dict(hf, num_layers),
            mrope_section=_mrope_section(hf, int(head_dim)),
            **(_gemma_settings(hf, model_type, num_layers) if model_type.startswith("gemma") else {}),
        )


def _gemma_settings(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """Gemma 2 and 3: interleaved sliding-window layers (`layer_types`, or the older every-Nth pattern), the
    local layers' RoPE base (Gemma 3), the attention scale and soft-caps. transformers applies the attention
    soft-cap in Gemma 2 only."""
    gemma3 = model_type.startswith("gemma3")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern") or (6 if gemma3 else 2))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    settings: dict[str, Any] = dict(
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or int(hf.get("head_dim") or 256)),
        attn_logit_softcap=None if gemma3 else _optional_float(hf.get("attn_logit_softcapping")),
        final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
    )
    if gemma3:
        local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
        settings["local_rope_theta"] = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    return settings


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling, from either transformers<5 (rope_scaling) or >=5 (rope_parameters; per layer type
    for Gemma 3, whose full-attention layers' settings these are)."""
    params = hf.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # LongRoPE's earlier name in Phi-3 configs
    if rope_type in ("default", "mrope"):  # M-RoPE's frequencies are the default ones (see _mrope_section)
        return theta, None
    if rope_type not in ("linear", "llama3", "yarn", "dynamic", "longrope"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, yarn, "
                         "dynamic, longrope, mrope")
    merged["rope_type"] = rope_type
    merged.pop("type", None)
    if rope_type in ("yarn", "longrope"):  # transformers' defaults: the model's own context, the factor stretching it
        top_level = hf.get("original_max_position_embeddings") if rope_type == "longrope" else None  # Phi-3
        merged.setdefault("original_max_position_embeddings",
                          int(top_level or hf.get("max_position_embeddings", 2048)))
        if merged.get("factor") is None:
            merged["factor"] = int(hf["max_position_embeddings"]) / merged["original_max_position_embeddings"]
    return theta, merged


def _mrope_section(hf: dict[str, Any], head_dim: int) -> tuple[int, ...] | None:
    section = (hf.get("rope_parameters") or {}).get("mrope_section") or (hf.get("rope_scaling") or {}).get(
        "mrope_section")
    if section is None:
        return None
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} must be 3 counts summing to head_dim / 2 = {head_dim // 2}")
    return tuple(int(n) for n in section)


def _rotary_dim(hf: dict[str, Any], head_dim: int) -> int | None:
    factor = float((hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return None if factor == 1.0 else int(head_dim * factor)


def _sliding_window(hf: dict[str, Any], qwen: bool) -> int | None:
    """Mistral sets `sliding_window`; Qwen2 and Qwen3 apply it only with `use_sliding_window` (off by default)."""
    window = hf.get("sliding_window")
    if window is None or (qwen and not hf.get("use_sliding_window", False)):
        return None
    return int(window)


# The torch.nn activations a cross-encoder's config may name for its scores (jvllm.pooling.scoring applies them).
SCORE_ACTIVATIONS = ("Identity", "Sigmoid", "Softmax", "Tanh")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A BERT-family bidirectional encoder (BERT, RoBERTa, XLM-R), read from an HF config dict."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    position_offset: int = 0  # RoBERTa numbers positions from pad_token_id + 1; BERT from 0
    matryoshka_dimensions: tuple[int, ...] | None = None  # output sizes the model was trained to truncate to
    eos_token_ids: tuple[int, ...] = ()  # an encoder never generates
    num_labels: int = 0  # a sequence classifier's (cross-encoder's) outputs; 0: a plain encoder
    score_activation: str | None = None  # the torch.nn class its config names for scores ('Sigmoid', 'Identity')

    is_encoder = True

    @property
    def is_cross_encoder(self) -> bool:
        """A sequence-pair classifier (`*ForSequenceClassification`): it scores pairs, it does not embed."""
        return self.num_labels > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """The longest input the position table allows."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "EncoderConfig":
        architecture = (hf.get("architectures") or ["BertModel"])[0]
        model_type = hf.get("model_type", "bert")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}; "
                             "only 'absolute' is implemented")
        pad = int(hf.get("pad_token_id") or 0)
        matryoshka = hf.get("matryoshka_dimensions")
        classifier = architecture.endswith("ForSequenceClassification")
        return cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(hf["num_attention_heads"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            hidden_act=str(hf.get("hidden_act", "gelu")),
            pad_token_id=pad,
            position_offset=pad + 1 if model_type in ("roberta", "xlm-roberta") else 0,
            matryoshka_dimensions=tuple(int(d) for d in matryoshka) if matryoshka else None,
            num_labels=_num_labels(hf) if classifier else 0,
            score_activation=_score_activation(hf) if classifier else None,
        )


def _num_labels(hf: dict[str, Any]) -> int:
    """A classifier's output count as transformers reads it: id2label's size, else num_labels (default 2)."""
    labels = hf.get("id2label")
    return len(labels) if labels else int(hf.get("num_labels", 2))


def _score_activation(hf: dict[str, Any]) -> str | None:
    """The activation a cross-encoder's config names for its scores, as sentence-transformers' CrossEncoder reads it
    (`sentence_transformers.activation_fn`, else the older `sbert_ce_default_activation_function`): the class name
    of a torch.nn path; None when it names none, or names something outside torch (CrossEncoder then uses its
    default too)."""
    st = hf.get("sentence_transformers")
    path = st.get("activation_fn") if isinstance(st, dict) else None
    path = path or hf.get("sbert_ce_default_activation_function")
    if not isinstance(path, str) or not path.startswith("torch.nn."):
        return None
    name = path.rsplit(".", 1)[-1]
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(f"the cross-encoder's config names the score activation {path}; supported: "
                         f"{', '.join(SCORE_ACTIVATIONS)}")
    return name
