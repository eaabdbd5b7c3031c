"""Products of 1-4 token rows with bfloat16 weights on XLA CPU through the native kernel (cpu_kernels.bf16_rows):
XLA CPU multiplies one row by a bf16 matrix ~10x slower than by a float32 one, so without it a one-token step reads
float32 weights (twice the bytes) or runs two rows, and its 2-4 row bf16 dots are slower than the kernel's."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("native_bf16_rows", default=False)


def bf16_rows_available() -> bool:
    """Whether this process can run the native product: XLA CPU with the native kernels built."""
    from models.quantized import native_kernel_available

    return jax.default_backend() == "cpu" and native_kernel_available()


@contextlib.contextmanager
def native_bf16_rows(enabled: bool) -> Iterator[None]:
    """Within: whether one-row products with bf16 weights take the native kernel (jvllm.worker.step_functions sets
    it around a step's layers and head for unsharded weights on CPU; sharded weights would be gathered for it)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def bf16_rows_dot(x: jax.Array, kernel: jax.Array, out_in: bool) -> jax.Array | None:
    """x [M, K] times a bf16 kernel ([N, K] with `out_in`, else [K, N]) -> [M, N] float32 (the weights widened
    exactly, float32 products and sums) where native_bf16_rows(True) is in effect and the build's kernel is the
    faster one for M rows (cpu_kernels.bf16_rows.bf16_rows_preferred: 1-4 with AVX-512, else 1); None otherwise
    (more rows, other dtypes), for the caller's XLA product."""
    if not _ENABLED.get() or x.ndim != 2 or kernel.dtype != jnp.bfloat16 or kernel.ndim != 2:
        return None
    from cpu_kernels.bf16_rows import bf16_rows_preferred, bf16_rows_product

    if not 1 <= x.shape[0] <= bf16_rows_preferred():
        return None

    return bf16_rows_product(x, kernel, out_in)
