"""Products of a few float32 rows with bfloat16 weights (bf16_rows.cc) as a JAX function, for XLA CPU."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels.build import load


@functools.lru_cache(maxsize=1)
def bf16_rows_max() -> int:
    """The most rows of x a call takes."""
    return int(load().JvllmBf16RowsMaxRows())


@functools.lru_cache(maxsize=1)
def bf16_rows_preferred() -> int:
    """The most rows of x for which this build's product beats XLA CPU's bf16 dot (4 with AVX-512, else 1)."""
    return int(load().JvllmBf16RowsPreferredRows())


def bf16_rows_product(x: jax.Array, w: jax.Array, out_in: bool) -> jax.Array:
    """x [M, K] float32 (M <= bf16_rows_max()) with bfloat16 weights w [N, K] (`out_in`) or [K, N] -> x @ W
    [M, N] float32: the bf16 weights widened exactly, float32 products and sums."""
    load()
    n = w.shape[0] if out_in else w.shape[1]
    call = jax.ffi.ffi_call("jvllm_bf16_rows", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), w, out_in=out_in)
