"""An encoder layer's attention within the sequences packed into its rows (encoder.cc) as a JAX function, for XLA
CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import load


def segment_attention(qkv: jax.Array, segments: jax.Array, bias: jax.Array, num_heads: int) -> jax.Array:
    """qkv [R, W, 3 H hd] float32 (queries, keys, values before their bias), segments [R, W] int32 (0: padding),
    bias [3 H hd] float32 -> [R, W, H hd] float32: each token's softmax((q + bq) (k + bk)^T / sqrt(hd)) (v + bv) over
    the tokens of its row with its own segment; padding -> 0."""
    load()
    rows, width, packed = qkv.shape
    out = jax.ShapeDtypeStruct((rows, width, packed // 3), jnp.float32)
    call = jax.ffi.ffi_call("jvllm_segment_attention", out, vmap_method="broadcast_all")
    return call(qkv, segments.astype(jnp.int32), bias, num_heads=np.int64(num_heads))
