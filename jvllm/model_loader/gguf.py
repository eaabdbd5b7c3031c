"""Read GGUF files (Llama, Mixtral, Qwen2/3 and their MoEs, Phi-3, Gemma 2/3) into HF-style config dicts, float32
numpy weights with HF names and fast tokenizers."""
from __future__ import annotations

from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from jvllm.model_loader.gguf_arch import (
    SUPPORTED_ARCHITECTURES,  # noqa: F401  (importable from here too)
    Architecture,
    GGUFHeader,
    architecture_for,
    fuse_phi3_attention,
    hf_name,
    split_experts,
)

# Tensors llama.cpp derives from the config (rope frequency factors), read into the config instead.
DERIVED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

# Pre-tokenizer regexes keyed by `tokenizer.ggml.pre`; gpt2-style ones use ByteLevel's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (Qwen2.5, Qwen3): the Llama 3 regex with every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SUPPORTED_PRE = ("default", "gpt2", "smollm", "llama-bpe", "qwen2")


class _PlainViewReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map: the reader slices the file once per metadata
    item (twice per vocabulary string), and a slice of a np.memmap pays for the subclass's bookkeeping each time
    (the embedded model's header: 1.6 s -> 0.5 s). The view reads the same mapped pages."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)


def open_gguf(source: str | GGUFHeader) -> GGUFHeader:
    """A file's header, parsed once (a large vocabulary takes a while): pass it to each reader below."""
    return source if isinstance(source, GGUFHeader) else GGUFHeader(_PlainViewReader(source))


def _llama3_rope_scaling(rope_freqs: np.ndarray, theta: float, low: float = 1.0,
                         high: float = 4.0) -> dict[str, Any]:
    """Recover HF llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (per-frequency divisors).

    The converter stores 1 for short wavelengths, `factor` for long ones and a blend in the band
    between. The band alone cannot pin down low/high_freq_factor and the original context length
    together, so low/high default to 1 and 4 (every published Llama 3.x) and the length is solved.
    """
    divisors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": 8192}
    in_band = (divisors > 1.0 + 1e-6) & (divisors < factor - 1e-6)
    if not in_band.any():
        return scaling  # no blended band: the length is unknowable, keep the Llama 3.x value
    index = np.nonzero(in_band)[0]
    wavelength = 2 * np.pi * theta ** (2 * index / (2 * divisors.size))
    blend = (factor / divisors[in_band] - 1.0) / (factor - 1.0)  # inverts 1 / ((1 - s) / factor + s)
    original = wavelength * (low + (high - low) * blend)  # from s = (L / wavelength - low) / (high - low)
    scaling["original_max_position_embeddings"] = int(round(float(np.median(original))))
    return scaling


def _rope_scaling(header: GGUFHeader, theta: float) -> dict[str, Any] | None:
    """HF rope_scaling from `rope.scaling.*` (linear, yarn) or llama.cpp's llama3 `rope_freqs` tensor."""
    scaling_type = header.arch_field("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": float(header.arch_field("rope.scaling.factor", 1.0))}
        optional = (("original_max_position_embeddings", "rope.scaling.original_context_length", int),
                    ("beta_fast", "rope.scaling.yarn_beta_fast", float),
                    ("beta_slow", "rope.scaling.yarn_beta_slow", float),
                    ("attention_factor", "rope.scaling.yarn_attn_factor", float))
        for hf_key, gguf_key, kind in optional:
            value = header.arch_field(gguf_key)
            if value is not None:
                scaling[hf_key] = kind(value)
        return scaling
    if "rope_freqs.weight" in header.tensors:
        return _llama3_rope_scaling(header.tensors["rope_freqs.weight"].data, theta)
    return None


def _vocab_size(header: GGUFHeader) -> int:
    """The embedding table's rows (what the weights hold), else the declared or listed vocabulary."""
    table = header.shape("token_embd.weight")
    if table is not None:
        return table[0]
    tokens = header.field("tokenizer.ggml.tokens")
    vocab = header.arch_field("vocab_size") or (len(tokens) if tokens else None)
    return int(vocab if vocab is not None else header.shape("output.weight")[0])


def read_gguf_config(source: str | GGUFHeader) -> dict:
    """An HF config.json-style dict for the model stored in a GGUF file (a path or its open_gguf header)."""
    header = open_gguf(source)
    architecture = architecture_for(header)
    hidden = int(header.arch_field("embedding_length"))
    heads = int(header.arch_field("attention.head_count"))
    head_dim = int(header.arch_field("attention.key_length") or hidden // heads)
    theta = float(header.arch_field("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [architecture.hf_class],
        "model_type": architecture.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(header.arch_field("feed_forward_length")),
        "num_hidden_layers": header.num_layers(),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.arch_field("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(header.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(header.arch_field("context_length", 2048)),
        "vocab_size": _vocab_size(header),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "mlp_bias": False,
    }
    rotary_dim = header.arch_field("rope.dimension_count")
    if rotary_dim and int(rotary_dim) != head_dim:  # RoPE on the leading dims of each head only
        config["partial_rotary_factor"] = int(rotary_dim) / head_dim
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        value = header.field(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    scaling = _rope_scaling(header, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    config.update(architecture.extra_config(header))
    return config


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF rotates the two halves of each head ("rotate half"); llama.cpp rotates adjacent pairs, so its
    converter reorders each head's rows from [half0, half1] to interleaved (x0, y0, x1, y1, ...).
    Reading the rows as (head, pair, 2) and swapping back to (head, 2, pair) restores HF order.
    """
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def dequantized_tensor(tensor: Any) -> np.ndarray:
    """A tensor as float32 in numpy order: GGUF lists dims fastest-first and the reader's array is already
    reversed, so a projection comes out [out_features, in_features] like torch's Linear.weight."""
    array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    expected = tuple(int(d) for d in reversed(tensor.shape))
    return array if array.shape == expected else array.reshape(expected)


def restore_tensor(name: str, array: np.ndarray, architecture: Architecture, header: GGUFHeader) -> np.ndarray:
    """Undo what llama.cpp's converter did to one tensor: q/k row order, norm offset, squeezed shapes."""
    if architecture.permuted_rope and ".self_attn.q_proj." in name:
        return _unpermute_rope_rows(array, int(header.arch_field("attention.head_count")))
    if architecture.permuted_rope and ".self_attn.k_proj." in name:
        heads = int(header.arch_field("attention.head_count"))
        return _unpermute_rope_rows(array, int(header.arch_field("attention.head_count_kv", heads)))
    if architecture.norm_offset and name.endswith("norm.weight"):
        return array - np.float32(architecture.norm_offset)
    if name.endswith(".shared_expert_gate.weight"):  # HF's Linear(hidden, 1)
        return array.reshape(1, -1)
    return array


def load_gguf_tensors(source: str | GGUFHeader) -> dict[str, np.ndarray]:
    """All weights dequantized to float32 numpy, with the names and [out, in] layouts of the HF checkpoint
    (experts one tensor each, Phi-3's fused projections fused)."""
    header = open_gguf(source)
    architecture = architecture_for(header)
    out: dict[str, np.ndarray] = {}
    for tensor in header.tensors.values():
        if tensor.name in DERIVED_TENSORS:
            continue
        name = hf_name(tensor.name, architecture)
        out.update(split_experts(name, restore_tensor(name, dequantized_tensor(tensor), architecture, header)))
    if architecture.hf_class == "Phi3ForCausalLM":
        fuse_phi3_attention(out)
    return out


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre == "smollm":
        # SmolLM was trained with every digit as its own token, split before the GPT-2 regex.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
        ])
    if pre in ("llama-bpe", "qwen2"):
        split = _LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_SUPPORTED_PRE)}")


def gguf_tokenizer(source: str | GGUFHeader) -> PreTrainedTokenizerFast:
    """A fast tokenizer rebuilt from the GGUF `tokenizer.*` metadata (no torch, no HF files)."""
    header = open_gguf(source)
    kind = header.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE). "
                         "Pass tokenizer=<a Hugging Face tokenizer folder> to load this model")
    tokens: list[str] = header.field("tokenizer.ggml.tokens")
    token_types: list[int] = header.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in header.field("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}

    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(header.field("tokenizer.ggml.add_space_prefix", False))
    pre = header.field("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, add_prefix_space)
    if pre == "qwen2":  # Qwen's own tokenizer composes text to NFC first
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens are matched before pre-tokenization and dropped by skip_special_tokens;
    # user-defined ones are matched whole too but kept when decoding.
    added = [AddedToken(tok, special=(kind_id == gguf.TokenType.CONTROL), normalized=False)
             for tok, kind_id in zip(tokens, token_types)
             if kind_id in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])

    def token_at(key: str) -> str | None:
        index = header.field(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(header.field("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(header.field("tokenizer.ggml.add_eos_token", False)) and eos is not None
    prefix = [f"{bos}:0"] if add_bos else []
    suffix = [f"{eos}:0"] if add_eos else []
    used = ([bos] if add_bos else []) + ([eos] if add_eos and eos != bos else [])
    specials = [(token, vocab[token]) for token in used]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*prefix, "$A:0", *suffix],
        pair=[*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=specials,
    )

    context = header.arch_field("context_length")
    kwargs: dict[str, Any] = {
        "tokenizer_object": tokenizer,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "chat_template": header.field("tokenizer.chat_template"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,  # byte-level BPE round-trips spaces exactly
    }
    if context:
        kwargs["model_max_length"] = int(context)
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
