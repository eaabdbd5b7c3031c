"""GGUF weights kept in their quantized blocks: which tensors stay quantized, and loading them into a model. The
projections and the embedding table (with a tied LM head) keep their blocks; everything else (norms, experts,
formats the kernels do not read) is dequantized to float as the converted-folder path does."""
from __future__ import annotations

import dataclasses
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.model_loader.gguf import DERIVED_TENSORS, dequantized_tensor, restore_tensor
from jvllm.model_loader.read_progress import weight_bar
from jvllm.model_loader.gguf_arch import (EXPERT, GGUFHeader, architecture_for, fuse_phi3_attention, hf_name,
                                          split_experts)
from models.hf_names import ArraySource, DerivedTensors
from models.layers import Linear

# GGUF tensor types whose blocks the models keep (models.quantized.FORMATS).
KEPT_TYPES = {
    gguf.GGMLQuantizationType.Q8_0: "q8_0",
    gguf.GGMLQuantizationType.Q4_0: "q4_0",
    gguf.GGMLQuantizationType.Q4_1: "q4_1",
    gguf.GGMLQuantizationType.Q4_K: "q4_k",
    gguf.GGMLQuantizationType.Q5_K: "q5_k",
    gguf.GGMLQuantizationType.Q6_K: "q6_k",
}


@dataclasses.dataclass
class GGUFWeights:
    """A GGUF file's weights by HF name: float32 arrays, and blocks [rows, row bytes] uint8 with their format."""

    floats: dict[str, np.ndarray]
    blocks: dict[str, tuple[np.ndarray, str]]

    @property
    def block_bytes(self) -> int:
        return sum(raw.nbytes for raw, _ in self.blocks.values())


def read_gguf_weights(header: GGUFHeader) -> GGUFWeights:
    """Every tensor of the file once: blocks of a kept type stay as they are (q/k rows put back in HF order),
    the rest is dequantized."""
    architecture = architecture_for(header)
    floats: dict[str, np.ndarray] = {}
    blocks: dict[str, tuple[np.ndarray, str]] = {}
    for tensor in header.tensors.values():
        if tensor.name in DERIVED_TENSORS:
            continue
        name = hf_name(tensor.name, architecture)
        fmt = KEPT_TYPES.get(tensor.tensor_type)
        if fmt is not None and EXPERT not in name and tensor.data.ndim == 2:
            blocks[name] = (restore_tensor(name, np.asarray(tensor.data), architecture, header), fmt)
        else:
            floats.update(split_experts(name, restore_tensor(name, dequantized_tensor(tensor), architecture, header)))
    if architecture.hf_class == "Phi3ForCausalLM":
        for name in [n for n in blocks if n.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight"))]:
            floats[name] = dequantize_blocks(*blocks.pop(name))
        fuse_phi3_attention(floats)
    return GGUFWeights(floats, blocks)


def dequantize_blocks(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Blocks [rows, row bytes] -> float32 [rows, weights per row] (gguf's reference dequantizer)."""
    qtype = next(t for t, name in KEPT_TYPES.items() if name == fmt)
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], -1)


def load_gguf_weights(module: Any, weights: GGUFWeights, dtype: Any) -> int:
    """Fill a module built abstractly: projections and the embedding table / LM head from blocks where the file has
    them, every other parameter from floats in `dtype`. -> the number of parameters holding blocks."""
    linears = {id(m.kernel): m for _, m in nnx.iter_modules(module) if isinstance(m, Linear)}
    num_experts = module.config.moe.num_experts if module.config.moe else 0
    raws = {name: raw for name, (raw, _) in weights.blocks.items()}
    formats = {name: fmt for name, (_, fmt) in weights.blocks.items()}
    source = DerivedTensors(ArraySource({**weights.floats, **raws}), num_experts)
    kept = 0
    with weight_bar(sum(raw.nbytes for raw in raws.values()) + sum(a.nbytes for a in weights.floats.values())) as bar:
        for param, name, transpose, _ in list(module.hf_parameters(source)):
            if name not in source:
                raise ValueError(f"the GGUF file is missing tensor {source.source_name(name)!r}")
            array = source.whole(name)
            bar.update(array.nbytes)
            fmt = formats.get(source.source_name(name))
            if fmt is not None:
                blocks = jnp.asarray(np.ascontiguousarray(array))
                owner = linears.get(id(param))
                if owner is not None and transpose:
                    owner.set_quantized(blocks, fmt)
                    kept += 1
                    continue
                if param is module.embed_tokens:
                    module.set_quantized_embedding(blocks, fmt)
                    kept += 1
                    continue
                if param is getattr(module, "lm_head", None) and transpose:
                    module.set_quantized_head(blocks, fmt)
                    kept += 1
                    continue
                array = dequantize_blocks(array, fmt)
            param.set_value(jnp.asarray(array.T if transpose else array, dtype=dtype))
    return kept
