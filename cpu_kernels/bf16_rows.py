"""Products of float32 rows with bfloat16 weights as JAX functions, for XLA CPU: a few rows (bf16_rows.cc), many rows
in bf16 tiles (bf16_weight_tiles.cc)."""
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


BF16_TILES_DEPTH_MULTIPLE = 32  # K of a tiled product: whole 32-value chunks
# Up to this many live rows, [N, K] weights are read in place against tiles of x (bf16_x_tiles.h) rather than moved
# into tiles themselves
BF16_X_TILES_MAX_ROWS = 48


@functools.lru_cache(maxsize=1)
def bf16_tiles_available() -> bool:
    """Whether this machine's build multiplies rows with bf16 weights in bf16 tiles (AVX-512 BF16)."""
    return bool(load().JvllmBf16TilesAvailable())


@functools.lru_cache(maxsize=1)
def amx_products() -> bool:
    """Whether the bf16 tiles (here and in the GGUF blocks' many-row products) run on Intel's AMX tile unit: the
    CPU has AMX-BF16, Linux granted the tile registers, and JVLLM_CPU_AMX is not 0 (AVX-512 BF16 otherwise)."""
    return bool(load().JvllmAmxProducts())


def bf16_tiles_product(x: jax.Array, w: jax.Array, out_in: bool, live_rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] float32 (K a multiple of 32) with bfloat16 weights w [N, K] (`out_in`) or [K, N] -> x @ W [M, N]
    float32: x rounded to bfloat16, float32 sums (XLA's bf16 x bf16 -> f32 dot, in another order). `live_rows` ([]
    int32, default M): only the first rows are multiplied, the others of the result are 0 (a step's padding). Up to
    BF16_X_TILES_MAX_ROWS live rows, [N, K] weights are read where they lie; otherwise they are moved into tiles."""
    load()
    m = x.shape[0]
    n = w.shape[0] if out_in else w.shape[1]
    call = jax.ffi.ffi_call("jvllm_bf16_tiles", jax.ShapeDtypeStruct((m, n), jnp.float32))
    live = jnp.asarray(m if live_rows is None else live_rows, jnp.int32).reshape(())
    return call(x.astype(jnp.float32), w, live, out_in=out_in)
