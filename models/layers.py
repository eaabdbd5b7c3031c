"""Building blocks shared by the decoder families: the projection (with its CPU layout choice), RMSNorm (Llama's
and Gemma's) and the gated MLP."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bf16_rows import bf16_rows_dot
from models.channel_quant import CHANNEL_FORMATS
from models.params import normal_param, value_or_none
from models.quantized import (check_quantized, native_float32, native_layout, quantized_dot,
                              quantized_gated_dot)


# Up to this many token rows, a kernel stored [out, in] is applied as (kernel @ x^T)^T, which XLA CPU runs faster
# at few rows; more rows contract x with it directly (docs/design/bf16_weights.md).
OUT_IN_TRANSPOSED_DOT_MAX_ROWS = 64


def stored_out_in(d_in: int, d_out: int) -> bool:
    """Whether the batched CPU weight copy keeps a d_in -> d_out kernel as [out, in]: the projections that
    narrow (down_proj, and k/v_proj under GQA), which XLA CPU multiplies faster that way
    (docs/design/bf16_weights.md)."""
    return d_in > d_out


def is_float_matrix(a: Any) -> bool:
    """A weight matrix in a float dtype of 16+ bits (what a lower-precision copy of the weights recasts; float8 codes
    of a per-channel format stay as they are)."""
    return a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > 1


def out_in_kernel_leaves(state: nnx.State) -> list[bool]:
    """Per leaf of a Llama state, in jax.tree.flatten order: whether it is a Linear kernel [in, out] that the
    batched copy stores [out, in] (float8 codes of a per-channel format are [out, in] already, and stay)."""
    return [getattr(path[-2], "key", None) == "kernel" and leaf.ndim == 2 and is_float_matrix(leaf)
            and stored_out_in(*leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), accumulation in float32. The kernel is [in, out], or [out, in] in the runner's
    batched copy when `stored_out_in` (told apart by shape: such a kernel is never square). A quantized Linear
    (`quant` names a format) holds GGUF blocks instead, [out, row bytes] uint8 (models.quantized), or per-channel
    codes [out, in] int8 / float8_e4m3fn with `scale` [out] float32 (models.channel_quant)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.kernel = normal_param(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.d_in, self.d_out = d_in, d_out
        self.quant: str | None = None
        self.scale: nnx.Param | None = None  # per-channel formats: [out] float32

    def set_quantized(self, blocks: jax.Array, fmt: str, scale: jax.Array | None = None) -> None:
        """Hold GGUF blocks [out, row bytes] of format `fmt` in place of the float kernel (in the native kernels'
        layout: models.quantized.native_layout), or for a per-channel format its codes [out, in] and `scale` [out]."""
        if check_quantized(blocks, scale, self.d_out, self.d_in, fmt, f"a {self.d_in} -> {self.d_out} projection"):
            self.scale = nnx.data(nnx.Param(scale))  # data, though it was a static None
        elif isinstance(blocks, (np.ndarray, jax.Array)):
            blocks, fmt = native_layout(blocks, fmt)
        self.kernel = nnx.Param(blocks)
        self.quant = fmt

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        if self.quant is not None:
            y = quantized_dot(x, kernel, self.quant, value_or_none(self.scale))  # [T, out] float32; scale [out]
            if self.bias is not None:
                y = y + self.bias[...].astype(jnp.float32)
            return y.astype(x.dtype)
        out_in = self.d_in != self.d_out and kernel.shape == (self.d_out, self.d_in)
        y = bf16_rows_dot(x, kernel, out_in)  # CPU steps of 1-4 token rows with bf16 weights, else None
        if y is None:
            # Cast the activation to the weight dtype, never the weights up: bf16 weights with f32 activations
            # must stay a bf16 x bf16 -> f32 dot (the fast CPU path), not a per-step f32 copy of the weights.
            xk = x.astype(kernel.dtype)  # [T, in]
            y = _dot_out_in(xk, kernel) if out_in else jnp.einsum("td,de->te", xk, kernel,
                                                                   preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def merge_output_columns(projections: Sequence[Linear]) -> int:
    """Make the first projection compute all of them, their outputs side by side, where they take the same input width
    and hold the same kind of weights: float kernels [in, out] of one dtype, GGUF blocks of one format, or per-channel
    codes of one format (their scales joined too); biases on all or none. One product instead of several: one weight
    stream, one launch or native call per step, and no concatenation for XLA to make at run time (XLA GPU's DotMerger
    joins small dots that share an operand by concatenating their weights inside every step). Each output column is
    computed as its own projection computes it. Float kernels split over n devices by output columns (tensor
    parallelism) are joined within each device's block: columns [first_0 | second_0 | ... | first_1 | ...], so every
    device keeps its own columns of each (`split_columns` reads them back). -> n (1: plain [first | second | ...]), or
    0 where they could not be merged (the others are then for the caller to drop)."""
    first, rest = projections[0], projections[1:]
    kernels = [p.kernel[...] for p in projections]
    if (not rest or any(p.quant != first.quant or p.d_in != first.d_in for p in rest)
            or len({k.dtype for k in kernels}) != 1 or len({p.bias is None for p in projections}) != 1):
        return 0
    shards = {column_shards(a) for p in projections for a in (p.kernel[...], value_or_none(p.bias)) if a is not None}
    if len(shards) != 1 or (first.quant is not None and shards != {1}):
        return 0
    (n,) = shards
    if first.quant is None:
        if any(k.shape != (p.d_in, p.d_out) for k, p in zip(kernels, projections)):
            return 0  # an [out, in] copy: merged only as loaded
        first.kernel = nnx.Param(join_columns(kernels, n))  # [in, sum of outs]
    else:  # one row per output
        first.kernel = nnx.Param(jnp.concatenate(kernels, axis=0))  # [sum of outs, row bytes or in]
        if first.scale is not None:
            first.scale = nnx.Param(jnp.concatenate([p.scale[...] for p in projections]))  # [sum of outs]
    if first.bias is not None:
        first.bias = nnx.Param(join_columns([p.bias[...] for p in projections], n))
    first.d_out = sum(p.d_out for p in projections)
    return n


def column_shards(a: jax.Array) -> int:
    """Into how many equal blocks the devices split a's last axis (1: every device holds it whole)."""
    sharding = getattr(a, "sharding", None)
    return 1 if sharding is None else a.shape[-1] // sharding.shard_shape(a.shape)[-1]


def join_columns(arrays: Sequence[jax.Array], shards: int) -> jax.Array:
    """[..., out_i] arrays -> [..., sum of outs]: side by side within each of `shards` equal blocks of columns,
    placed as the first array is (each device's block built from its own blocks of the others)."""
    if shards == 1:
        return jnp.concatenate(arrays, axis=-1)

    def join(*parts: jax.Array) -> jax.Array:
        lead = parts[0].shape[:-1]
        blocks = [p.reshape(*lead, shards, p.shape[-1] // shards) for p in parts]  # [..., n, out_i / n]
        return jnp.concatenate(blocks, axis=-1).reshape(*lead, -1)

    return jax.jit(join, out_shardings=arrays[0].sharding)(*arrays)


def split_columns(y: jax.Array, widths: Sequence[int], shards: int) -> list[jax.Array]:
    """A joined projection's output [T, sum of widths] -> each projection's [T, width] (`merge_output_columns`'s
    layout for `shards` blocks of columns; the split stays within each device's block)."""
    if shards == 1:
        return jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1)
    tokens = y.shape[0]
    blocks = jnp.split(y.reshape(tokens, shards, -1), np.cumsum([w // shards for w in widths])[:-1].tolist(), axis=-1)
    return [block.reshape(tokens, width) for block, width in zip(blocks, widths)]


def _dot_out_in(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [T, in] with kernel [out, in] -> [T, out] float32."""
    contract_in = (((1,), (1,)), ((), ()))
    if 1 < x.shape[0] <= OUT_IN_TRANSPOSED_DOT_MAX_ROWS:
        y_t = jax.lax.dot_general(kernel, x, contract_in, preferred_element_type=jnp.float32)  # [out, T]
        return jax.lax.optimization_barrier(y_t).T  # the barrier stops XLA folding the transpose back into the dot
    return jax.lax.dot_general(x, kernel, contract_in, preferred_element_type=jnp.float32)


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x [..., D] divided by its root mean square over D, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """On XLA CPU with the native kernels, float32 norms run as one pass per row (cpu_kernels.rms_norm), and
    `add_and_norm` folds the residual add in: XLA makes three passes of them (add, reduction, scaling)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def _native(self, *xs: jax.Array) -> bool:
        return native_float32(self.weight[...], *xs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self._native(x):
            from cpu_kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight[...], self.eps)
        normed = rms_normalized(x, self.eps)
        return self.weight[...] * normed.astype(x.dtype)  # transformers' order; f32 when the weight is bf16

    def adds_natively(self, x: jax.Array) -> bool:
        """Whether add_and_norm of x's dtype runs as one native pass (the same bits as the add, then the norm)."""
        return self._native(x, x)

    def add_and_norm(self, x: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + delta, its norm)."""
        if self._native(x, delta) and x.shape == delta.shape:
            from cpu_kernels.rms_norm import add_rms_norm

            return add_rms_norm(x, delta, self.weight[...], self.eps)
        total = x + delta
        return total, self(total)


class GemmaRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight), all in float32, then cast to x's dtype (Gemma's order; the weight is stored as
    an offset from 1)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)), d -> f -> d: SwiGLU with `silu` (Llama), GeGLU with `gelu_tanh` (Gemma)."""

    def __init__(self, d: int, f: int, dtype: jnp.dtype, rngs: nnx.Rngs | None, activation=jax.nn.silu):
        self.gate_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj: Linear | None = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, bias=False, dtype=dtype, rngs=rngs)
        self.activation = activation
        self.joined_shards = 1  # gate and up joined (fuse_gate_up): their columns' blocks (merge_output_columns)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.up_proj is None:  # gate and up as one projection (fuse_gate_up): columns [gate | up]
            width = self.gate_proj.d_out // 2
            gate, up = split_columns(self.gate_proj(x), (width, width), self.joined_shards)  # [T, f] each
            return self.down_proj(self.activation(gate) * up)
        hidden = self._fused_silu_hidden(x)  # [T, f]
        if hidden is None:
            hidden = self.activation(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(hidden)

    def fuse_gate_up(self) -> bool:
        """Hold gate and up as one projection (models.layers.merge_output_columns), except GGUF blocks, whose
        native gated product already makes both in one call. -> whether fused."""
        gate, up = self.gate_proj, self.up_proj
        if up is None or (gate.quant is not None and gate.quant not in CHANNEL_FORMATS):
            return False
        shards = merge_output_columns([gate, up])
        if not shards:
            return False
        self.up_proj, self.joined_shards = None, shards
        return True

    def _fused_silu_hidden(self, x: jax.Array) -> jax.Array | None:
        """silu(gate(x)) * up(x) from one native call where gate and up hold GGUF blocks of one format, else None."""
        gate, up = self.gate_proj, self.up_proj
        if (self.activation is not jax.nn.silu or gate.quant is None or gate.quant != up.quant
                or gate.bias is not None or up.bias is not None):
            return None
        hidden = quantized_gated_dot(x, gate.kernel[...], up.kernel[...], gate.quant)
        return None if hidden is None else hidden.astype(x.dtype)


def mlp_hf_parameters(mlp: MLP, prefix: str, axis: str = "mlp") -> Iterator[tuple]:
    """(parameter, HF name, transposed, logical axes) of a gated MLP: gate/up split by output columns, down by
    input rows, along the logical axis `axis` (tensor parallelism all-reduces down's partial sums)."""
    if mlp.up_proj is None:
        raise ValueError("gate and up were fused after loading (MLP.fuse_gate_up): their HF tensors are gone")
    for name in ("gate_proj", "up_proj"):
        yield getattr(mlp, name).kernel, prefix + name + ".weight", True, ("embed", axis)
    yield mlp.down_proj.kernel, prefix + "down_proj.weight", True, (axis, "embed")
