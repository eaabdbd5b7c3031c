"""Float checkpoints quantized at load (`quantization="int8"` or `"fp8"`): every projection, the embedding table and an
untied LM head become quantized weights; norms, biases, experts and vision towers stay float. On CPU, int8 is GGUF's
Q8_0 layout (an int8 per weight, a half-precision scale per 32 along the input dimension), the layout the CPU kernels
read; on accelerators, int8 and fp8 are codes with a float32 scale per output channel (models.channel_quant), which
XLA's dots take with the convert fused. fp8 on CPU is refused (XLA CPU has no fused float8 dot)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.channel_quant import CHANNEL_FORMATS, quantize_channels
from models.layers import Linear
from models.quantized import FORMATS, quantize_reference

# quantization= value -> (the format on CPU, the format on accelerators); None: refused there.
QUANTIZATIONS: dict[str, tuple[str | None, str]] = {"int8": ("q8_0", "int8_channel"), "fp8": (None, "fp8_channel")}


def load_backend() -> str:
    """The platform the weights are quantized for: JAX's default backend, where the loaded arrays live."""
    return jax.default_backend()


def storage_format(quantization: str, backend: str | None = None) -> str:
    """The format `quantization` stores the weights in on `backend` (default: `load_backend()`); ValueError where
    that quantization does not run."""
    cpu, accelerator = QUANTIZATIONS[quantization]
    fmt = cpu if (backend or load_backend()) == "cpu" else accelerator
    if fmt is None:
        raise ValueError(f"quantization={quantization!r} runs on GPUs (XLA CPU has no fused float8 dot); on CPU use "
                         "quantization='int8' (Q8_0 blocks read by the native kernels)")
    return fmt


def _blocks(rows: np.ndarray, fmt: str) -> jnp.ndarray:
    """float [N, K] (one row per output) -> blocks [N, row bytes] uint8."""
    return jnp.asarray(quantize_reference(np.asarray(rows, dtype=np.float32), fmt))


def quantize_module(module: Any, quantization: str, backend: str | None = None) -> int:
    """Replace the float weights of a loaded language model by quantized ones in place, in the format
    `storage_format(quantization, backend)` names; -> how many tensors were quantized. In Q8_0 blocks, projections
    whose input width is not whole blocks keep their floats."""
    fmt = storage_format(quantization, backend)
    if not hasattr(module, "set_quantized_embedding"):
        raise ValueError(f"{module.config.architecture} does not run on quantized weights; leave quantization unset")
    if fmt in CHANNEL_FORMATS:
        return _quantize_channels(module, fmt)
    block = FORMATS[fmt].block_size
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


def _quantize_channels(module: Any, fmt: str) -> int:
    """Per-channel codes [out, in] and scales [out] for every float projection, the LM head and the embedding
    table, quantized on the device that holds them."""
    quantized = 0
    for _, layer in list(nnx.iter_modules(module)):
        if isinstance(layer, Linear) and layer.quant is None:
            codes, scale = quantize_channels(layer.kernel[...], fmt, transposed=True)  # [in, out] -> [out, in], [out]
            layer.set_quantized(codes, fmt, scale)
            quantized += 1
    if getattr(module, "lm_head", None) is not None:
        codes, scale = quantize_channels(module.lm_head[...], fmt, transposed=True)  # [D, V] -> [V, D], [V]
        module.set_quantized_head(codes, fmt, scale)
        quantized += 1
    codes, scale = quantize_channels(module.embed_tokens[...], fmt)  # [V, D], [V]
    module.set_quantized_embedding(codes, fmt, scale)
    return quantized + 1
