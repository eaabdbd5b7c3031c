"""Weight-only quantization for accelerators: int8 or float8_e4m3fn codes with one float32 scale per output channel."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ChannelFormat:
    """Codes of `dtype` [out, in], one float32 scale per output row: weight = code * scale. A row's largest
    magnitude maps to `max_code` (symmetric, absmax calibration; no zero point)."""

    name: str
    dtype: jnp.dtype
    max_code: float

    @property
    def integer(self) -> bool:
        return jnp.issubdtype(self.dtype, jnp.integer)


# int8: codes in [-127, 127] (vLLM's and GGUF Q8_0's absmax / 127). fp8: e4m3fn's largest finite value, 448.
CHANNEL_FORMATS = {f.name: f for f in (ChannelFormat("int8_channel", jnp.dtype(jnp.int8), 127.0),
                                       ChannelFormat("fp8_channel", jnp.dtype(jnp.float8_e4m3fn), 448.0))}


@functools.partial(jax.jit, static_argnames=("fmt", "transposed"))
def quantize_channels(w: jax.Array, fmt: str, transposed: bool = False) -> tuple[jax.Array, jax.Array]:
    """float w [N, K] (one row per output; [K, N] with `transposed`, a Linear kernel) -> (codes [N, K] in fmt's
    dtype, scales [N] float32). Runs where w lives (on the GPU at load: no host round trip of the weights)."""
    spec = CHANNEL_FORMATS[fmt]
    w32 = w.astype(jnp.float32)
    w32 = w32.T if transposed else w32  # [N, K]
    absmax = jnp.max(jnp.abs(w32), axis=1)  # [N]
    scale = jnp.where(absmax > 0, absmax / spec.max_code, 1.0)  # [N]; an all-zero row keeps scale 1
    q = jnp.clip(w32 / scale[:, None], -spec.max_code, spec.max_code)  # [N, K]; clipped: e4m3fn has no inf
    if spec.integer:
        q = jnp.round(q)  # to nearest, ties to even; e4m3fn's convert rounds the same way
    return q.astype(spec.dtype), scale


def check_channels(codes: jax.Array, scale: jax.Array | None, rows: int, k: int, fmt: str, what: str) -> None:
    """ValueError unless `codes` [rows, k] are of fmt's dtype and `scale` is float32 [rows]."""
    spec = CHANNEL_FORMATS[fmt]
    if tuple(codes.shape) != (rows, k) or codes.dtype != spec.dtype:
        raise ValueError(f"{fmt} codes of {what} are {spec.dtype} {(rows, k)}, got {codes.dtype} {tuple(codes.shape)}")
    if scale is None or tuple(scale.shape) != (rows,) or scale.dtype != jnp.float32:
        got = None if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
        raise ValueError(f"{fmt} scales of {what} are float32 ({rows},), got {got}")


def channel_dot(x: jax.Array, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """x [T, K] (bfloat16 on a GPU) with codes [N, K] and scales [N] -> x @ (codes * scale)^T [T, N] float32.

    The codes are converted to x's dtype as the dot's operand, which XLA GPU fuses into the GEMM (the weights
    cross memory as 1-byte codes); the conversion is exact (every int8 and every e4m3fn value is a bfloat16 value),
    and the scales multiply the float32 result [T, N] rather than the weights [N, K]. The codes are K-major
    ([out, in], K contiguous), the layout 8-bit tensor-core operands take (docs/design/gpu_and_parallel.md)."""
    w = codes.astype(x.dtype)  # [N, K]
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [T, N]
    return y * scale


def channel_rows(codes: jax.Array, scale: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` [T] of a quantized table, codes [V, K] and scales [V] -> float32 [T, K] (an embedding lookup)."""
    return codes[ids].astype(jnp.float32) * scale[ids][:, None]


def dequantize_channels(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """codes [N, K] and scales [N] -> the weights they stand for, float32 [N, K]."""
    return codes.astype(jnp.float32) * scale[:, None]
