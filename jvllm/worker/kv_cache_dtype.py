"""The KV pool's dtype: the engine's `kv_cache_dtype` option resolved against the model it serves."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def kv_cache_dtype_for(requested: str | None, dtype: str | Any, loaded: Any) -> jnp.dtype:
    """The dtype of the values the KV pages hold.

    `requested` is the engine's `kv_cache_dtype`: "float32", "bfloat16", or "auto" (None): the model's own dtype,
    except bfloat16 on CPU where `dtype` was "auto" itself and the weights are not float32's: a GGUF model on its
    quantized blocks (as in llama.cpp, whose KV cache holds 16-bit floats by default) and a float checkpoint whose
    matrices were loaded in bfloat16 (as vLLM's CPU build runs it, bf16 pages included). Decode attention then
    reads half the bytes; `dtype="float32"` keeps the pages in float32."""
    if requested is None or requested == "auto":
        if dtype == "auto" and jax.default_backend() == "cpu" and (loaded.keeps_blocks or loaded.has_bf16_matrices):
            return jnp.dtype(jnp.bfloat16)
        return jnp.dtype(loaded.dtype)
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {requested!r} is not supported; choose auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(KV_CACHE_DTYPES[requested])
