"""The KV pool's dtype: the engine's `kv_cache_dtype` option resolved against the model it serves."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8_e5m2": jnp.float8_e5m2}
EIGHT_BIT_BACKENDS = ("cpu", "xla")  # the attention backends that read 8-bit pages


def kv_cache_dtype_for(requested: str | None, dtype: str | Any, loaded: Any, backend: str = "cpu") -> jnp.dtype:
    """The dtype of the values the KV pages hold.

    `requested` is the engine's `kv_cache_dtype`: "float32", "bfloat16", "fp8_e5m2", or "auto" (None): the model's
    own dtype, except bfloat16 on CPU where `dtype` was "auto" itself and the weights are not float32's: a GGUF model
    on its quantized blocks (as in llama.cpp, whose KV cache holds 16-bit floats by default) and a float checkpoint
    whose matrices were loaded in bfloat16 (as vLLM's CPU build runs it, bf16 pages included). Decode attention then
    reads half the bytes; `dtype="float32"` keeps the pages in float32. "fp8_e5m2" stores 8-bit floats (5 exponent,
    2 mantissa bits, rounded to nearest, no scales: vLLM's CPU KV cache format), half the bytes of bfloat16 again,
    read by the `cpu` and `xla` attention backends (`backend`); the model then computes in bfloat16."""
    if requested is None or requested == "auto":
        if dtype == "auto" and jax.default_backend() == "cpu" and (loaded.keeps_blocks or loaded.has_bf16_matrices):
            return jnp.dtype(jnp.bfloat16)
        return jnp.dtype(loaded.dtype)
    if requested in ("fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype {requested!r} (float8 e4m3 with scales) is not supported; fp8_e5m2 is")
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {requested!r} is not supported; choose auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    if requested == "fp8_e5m2" and backend not in EIGHT_BIT_BACKENDS:
        raise ValueError(f"kv_cache_dtype 'fp8_e5m2' is read by the {' and '.join(EIGHT_BIT_BACKENDS)} attention "
                         f"backends, not by {backend!r}")
    return jnp.dtype(KV_CACHE_DTYPES[requested])
