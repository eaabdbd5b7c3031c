"""Products with bfloat16 weights on XLA CPU through the native kernels (cpu_kernels.bf16_rows): XLA CPU multiplies
one row by a bf16 matrix ~10x slower than by a float32 one, so without them a one-token step reads float32 weights
(twice the bytes) or runs two rows, and its bf16 dots of 2-64 rows run at a fraction of the tiles' rate (with
AVX-512 BF16; docs/design/bf16_weights.md, "A float checkpoint's batched steps in bf16 tiles")."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("native_bf16_rows", default=False)
# The shapes the tiles take, those where they are as fast as XLA's bf16 dot or faster at 5-2,048 rows (2-core Zen 4):
# not the widest outputs (an LM head's vocabulary: each call would move every weight into tiles for a few rows)
# except [N, K] ones for up to BF16_X_TILES_MAX_ROWS rows (read in place there), and [K, N] kernels only up to this K
# (their tiles gather 16 columns from every row of K; past it XLA's row-order reads are faster at 5-16 rows)
TILES_MAX_OUTPUTS = 16384
TILES_MAX_IN_OUT_DEPTH = 1024


def bf16_rows_available() -> bool:
    """Whether this process can run the native product: XLA CPU with the native kernels built."""
    from models.quantized import native_cpu_kernels

    return native_cpu_kernels()


@contextlib.contextmanager
def native_bf16_rows(enabled: bool) -> Iterator[None]:
    """Within: whether products with bf16 weights take the native kernels (jvllm.worker.step_functions sets
    it around a step's layers and head for unsharded weights on CPU; sharded weights would be gathered for it)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def bf16_rows_dot(x: jax.Array, kernel: jax.Array, out_in: bool) -> jax.Array | None:
    """x [M, K] times a bf16 kernel ([N, K] with `out_in`, else [K, N]) -> [M, N] float32 where native_bf16_rows(True)
    is in effect: for the rows the few-row kernel takes faster than XLA (cpu_kernels.bf16_rows.bf16_rows_preferred:
    1-4 with AVX-512, else 1) the weights widened exactly, float32 products and sums; for more rows, with AVX-512
    BF16, x rounded to bf16 in bf16 tiles (XLA's numbers, another summation order) where they are faster (_tiles_dot).
    None otherwise (other shapes and dtypes), for the caller's XLA product."""
    if not _ENABLED.get() or x.ndim != 2 or kernel.dtype != jnp.bfloat16 or kernel.ndim != 2:
        return None
    from cpu_kernels.bf16_rows import bf16_rows_preferred, bf16_rows_product

    if 1 <= x.shape[0] <= bf16_rows_preferred():
        return bf16_rows_product(x, kernel, out_in)
    return _tiles_dot(x, kernel, out_in)


def _tiles_dot(x: jax.Array, kernel: jax.Array, out_in: bool) -> jax.Array | None:
    """x [M, K] (M past the few-row kernel's) times the bf16 kernel in bf16 tiles, the step's padding rows skipped,
    where this build has them and they are the faster product for the shape; None otherwise."""
    from cpu_kernels.bf16_rows import (BF16_TILES_DEPTH_MULTIPLE, BF16_X_TILES_MAX_ROWS, bf16_tiles_available,
                                       bf16_tiles_product)
    from models.live_rows import live_rows_of

    k, n = x.shape[1], kernel.shape[0] if out_in else kernel.shape[1]
    in_place = out_in and x.shape[0] <= BF16_X_TILES_MAX_ROWS
    if (not bf16_tiles_available() or k % BF16_TILES_DEPTH_MULTIPLE or (n > TILES_MAX_OUTPUTS and not in_place)
            or (not out_in and k > TILES_MAX_IN_OUT_DEPTH)):
        return None
    return bf16_tiles_product(x, kernel, out_in, live_rows_of(x.shape[0]))
