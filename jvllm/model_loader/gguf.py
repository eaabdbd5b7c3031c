"""Read llama-family GGUF files into HF-style config dicts, float32 numpy weights and fast tokenizers."""
from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-block tensor names -> Hugging Face LlamaForCausalLM names (suffix .weight/.bias kept).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives from the config rather than from checkpoint weights.
_DERIVED_TENSORS = {"rope_freqs.weight"}

# Pre-tokenizer regexes keyed by `tokenizer.ggml.pre`; gpt2-style ones use ByteLevel's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SUPPORTED_PRE = ("default", "gpt2", "smollm", "llama-bpe")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (str/int/float/bool/list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


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


def read_gguf_config(path: str) -> dict:
    """An HF config.json-style dict for the llama-family model stored in a GGUF file."""
    reader = gguf.GGUFReader(path)
    arch = _architecture(reader)
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling_type,
                                  "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    elif "rope_freqs.weight" in tensor_names:
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config["rope_scaling"] = _llama3_rope_scaling(freqs.data, theta)
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


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def load_gguf_tensors(path: str) -> dict[str, np.ndarray]:
    """All weights dequantized to float32 numpy, with Hugging Face names and [out, in] layouts."""
    reader = gguf.GGUFReader(path)
    arch = _architecture(reader)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.name in _DERIVED_TENSORS:
            continue
        # GGUF lists dims fastest-first; the reader's array is already in numpy (reversed) order,
        # so dequantize yields [out_features, in_features] like torch's Linear.weight.
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if array.shape != expected:
            array = array.reshape(expected)
        name = _hf_name(tensor.name)
        if ".self_attn.q_proj." in name:
            array = _unpermute_rope_rows(array, heads)
        elif ".self_attn.k_proj." in name:
            array = _unpermute_rope_rows(array, kv_heads)
        out[name] = array
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
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_SUPPORTED_PRE)}")


def gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer rebuilt from the GGUF `tokenizer.*` metadata (no torch, no HF files)."""
    reader = gguf.GGUFReader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}

    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"),
                                             add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens are matched before pre-tokenization and dropped by skip_special_tokens;
    # user-defined ones are matched whole too but kept when decoding.
    added = [AddedToken(tok, special=(kind_id == gguf.TokenType.CONTROL), normalized=False)
             for tok, kind_id in zip(tokens, token_types)
             if kind_id in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])

    def token_at(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    prefix = [f"{bos}:0"] if add_bos else []
    suffix = [f"{eos}:0"] if add_eos else []
    used = ([bos] if add_bos else []) + ([eos] if add_eos and eos != bos else [])
    specials = [(token, vocab[token]) for token in used]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*prefix, "$A:0", *suffix],
        pair=[*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=specials,
    )

    context = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    kwargs: dict[str, Any] = {
        "tokenizer_object": tokenizer,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,  # byte-level BPE round-trips spaces exactly
    }
    if context:
        kwargs["model_max_length"] = int(context)
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
