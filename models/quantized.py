"""Weights kept in GGUF's quantized blocks: the formats, their dequantization in jnp, and the product with them (the
native CPU kernel on XLA CPU, dequantize-then-dot elsewhere)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format: `block_bytes` bytes hold `block_size` consecutive weights of one row."""

    name: str
    block_size: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        if k % self.block_size:
            raise ValueError(f"{self.name}: a row of {k} weights is not whole blocks of {self.block_size}")
        return k // self.block_size * self.block_bytes


FORMATS = {f.name: f for f in (BlockFormat("q8_0", 32, 34), BlockFormat("q4_0", 32, 18), BlockFormat("q4_1", 32, 20))}


def check_blocks(blocks: jax.Array, rows: int, k: int, fmt: str, what: str) -> None:
    """ValueError unless `blocks` holds `rows` rows of `k` weights in format `fmt` ([rows, row bytes] uint8)."""
    expected = (rows, FORMATS[fmt].row_bytes(k))
    if tuple(blocks.shape) != expected or blocks.dtype != jnp.uint8:
        raise ValueError(f"{fmt} blocks of {what} are uint8 {expected}, got {blocks.dtype} {tuple(blocks.shape)}")


def _halves(pair: jax.Array) -> jax.Array:
    """[..., 2] uint8, little-endian IEEE half -> [...] float32."""
    bits = pair[..., 0].astype(jnp.uint16) | (pair[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(packed: jax.Array) -> jax.Array:
    """[..., 16] uint8 -> [..., 32] float32: the low nibbles (elements 0-15), then the high ones (16-31)."""
    return jnp.concatenate([packed & 15, packed >> 4], axis=-1).astype(jnp.float32)


def dequantize(raw: jax.Array, fmt: str, k: int) -> jax.Array:
    """raw [..., row_bytes] uint8, rows of `k` weights in format `fmt` -> float32 [..., k]."""
    spec = FORMATS[fmt]
    blocks = raw.reshape(*raw.shape[:-1], k // spec.block_size, spec.block_bytes)  # [..., B, bytes]
    d = _halves(blocks[..., 0:2])[..., None]  # [..., B, 1]
    if fmt == "q8_0":
        w = jax.lax.bitcast_convert_type(blocks[..., 2:34], jnp.int8).astype(jnp.float32) * d
    elif fmt == "q4_0":
        w = (_nibbles(blocks[..., 2:18]) - 8.0) * d
    else:  # q4_1
        w = _nibbles(blocks[..., 4:20]) * d + _halves(blocks[..., 2:4])[..., None]
    return w.reshape(*raw.shape[:-1], k)


@functools.lru_cache(maxsize=1)
def native_kernel_available() -> bool:
    from cpu_kernels.build import available

    return available()


# Steps of up to this many token rows multiply with activations quantized to int16 blocks (integer dot products,
# each weight row read once per activation row); larger ones dequantize weight tiles to float32 once for all rows.
INT16_ACTIVATION_MAX_ROWS = 8


def quantized_dot(x: jax.Array, raw: jax.Array, fmt: str) -> jax.Array:
    """x [T, K] with weights raw [N, row_bytes] (one GGUF row per output) -> x @ W^T [T, N] float32."""
    if jax.default_backend() == "cpu" and native_kernel_available():
        from cpu_kernels.quantized_matmul import quantized_matmul

        return quantized_matmul(x, raw, fmt, INT16_ACTIVATION_MAX_ROWS)
    w = dequantize(raw, fmt, x.shape[-1])  # [N, K]
    return jnp.einsum("tk,nk->tn", x.astype(jnp.float32), w, preferred_element_type=jnp.float32)


def dequantized_rows(raw: jax.Array, ids: jax.Array, fmt: str, k: int) -> jax.Array:
    """Rows `ids` [T] of a quantized table raw [V, row_bytes] -> float32 [T, k] (an embedding lookup)."""
    return dequantize(raw[ids], fmt, k)


def quantize_reference(weights: np.ndarray, fmt: str) -> np.ndarray:
    """float [N, K] -> its GGUF blocks [N, row_bytes] uint8, as llama.cpp's converter writes them (tests, dummy
    quantized weights)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    raw = gguf.quants.quantize(np.ascontiguousarray(weights, dtype=np.float32), qtype)
    return np.asarray(raw, dtype=np.uint8).reshape(weights.shape[0], -1)
