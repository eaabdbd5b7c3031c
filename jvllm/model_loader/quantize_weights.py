"""Float checkpoints quantized at load (`quantization="int8"`): every projection, the embedding table and an untied
LM head become int8 blocks in GGUF's Q8_0 layout (an int8 per weight, a half-precision scale per 32 along the input
dimension), the layout the CPU kernels read; norms, biases, experts and vision towers stay float."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Linear
from models.quantized import FORMATS, quantize_reference

# quantization= value -> the block format the weights are stored in.
QUANTIZATIONS = {"int8": "q8_0"}


def _blocks(rows: np.ndarray, fmt: str) -> jnp.ndarray:
    """float [N, K] (one row per output) -> blocks [N, row bytes] uint8."""
    return jnp.asarray(quantize_reference(np.asarray(rows, dtype=np.float32), fmt))


def quantize_module(module: Any, quantization: str) -> int:
    """Replace the float weights of a loaded language model by blocks in place; -> how many tensors were quantized.
    Projections whose input width is not whole blocks keep their floats."""
    fmt = QUANTIZATIONS[quantization]
    block = FORMATS[fmt].block_size
    if not hasattr(module, "set_quantized_embedding"):
        raise ValueError(f"{module.config.architecture} does not run on quantized weights; leave quantization unset")
    quantized = 0
    for _, layer in list(nnx.iter_modules(module)):
        if isinstance(layer, Linear) and layer.quant is None and layer.d_in % block == 0:
            layer.set_quantized(_blocks(np.asarray(layer.kernel[...]).T, fmt), fmt)  # kernel [in, out]
            quantized += 1
    if module.config.hidden_size % block == 0:
        if getattr(module, "lm_head", None) is not None:
            module.set_quantized_head(_blocks(np.asarray(module.lm_head[...]).T, fmt), fmt)  # [D, V] -> [V, D]
            quantized += 1
        module.set_quantized_embedding(_blocks(np.asarray(module.embed_tokens[...]), fmt), fmt)  # [V, D]
        quantized += 1
    return quantized
