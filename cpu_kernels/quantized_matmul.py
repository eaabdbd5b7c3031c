"""Products with GGUF-quantized weights (quantized_matmul.cc) as a JAX function, for XLA CPU."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import load

# GGUF block formats the kernel reads: name -> (its code in the kernel, weights per block, bytes per block).
# q8_0x8 / q4_0x8 / q4_1x8: the same with the blocks of 8 weight rows interleaved; q8_0x16 / ...: grouped by code
# words for 16 rows (models.quantized.interleave_rows).
FORMATS = {"q8_0": (0, 32, 34), "q4_0": (1, 32, 18), "q4_1": (2, 32, 20),
           "q4_k": (3, 256, 144), "q5_k": (4, 256, 176), "q6_k": (5, 256, 210),
           "q4_0x8": (6, 32, 18), "q4_1x8": (7, 32, 20), "q8_0x8": (8, 32, 34),
           "q4_0x16": (9, 32, 18), "q4_1x16": (10, 32, 20), "q8_0x16": (11, 32, 34)}


@functools.lru_cache(maxsize=1)
def row_path_limits() -> tuple[int, int]:
    """(int16_max_rows, int16_tile_min_rows) that suit this machine's kernel build (its vector width and integer
    dot products)."""
    library = load()
    return int(library.JvllmInt16MaxRows()), int(library.JvllmInt16TileMinRows())


@functools.lru_cache(maxsize=1)
def interleaved_rows_preferred() -> bool:
    """Whether this machine's kernel build multiplies Q8_0 / Q4_0 / Q4_1 weights fastest interleaved by groups of 8 rows
    (AVX2 builds without AVX-512; any AVX2 build reads that layout)."""
    return bool(load().JvllmInterleavedRowsPreferred())


@functools.lru_cache(maxsize=1)
def word_groups_preferred() -> bool:
    """Whether this machine's kernel build multiplies Q8_0 / Q4_0 / Q4_1 weights fastest grouped by code words for 16
    rows (AVX-512 builds with BF16; only those read that layout)."""
    return bool(load().JvllmWordGroupsPreferred())


@functools.lru_cache(maxsize=1)
def bf16_max_rows() -> int:
    """The most live rows this machine's kernel build multiplies in bfloat16 (8 with AVX-512 BF16, else 0)."""
    return int(load().JvllmBf16MaxRows())


@functools.lru_cache(maxsize=1)
def invariant_max_rows() -> int:
    """The most live rows this machine's kernel build multiplies on the invariant path (32 with AVX-512, else 0)."""
    return int(load().JvllmInvariantMaxRows())


@functools.lru_cache(maxsize=1)
def amx_block_sum_min_rows() -> int:
    """From how many live rows (up to 16) the invariant path's products with word-grouped Q8_0 / Q4_0 / Q4_1 weights
    sum their blocks on Intel's AMX tile unit (AMX-INT8 CPUs; the same bits as the vector loops); 0: never."""
    return int(load().JvllmAmxBlockSumMinRows())


@functools.lru_cache(maxsize=1)
def int8_tile_min_rows() -> int:
    """From how many live rows this machine's kernel build multiplies 4- and 5-bit blocks with 8-bit activations
    when asked to (int8_tile_formats: which; 0: never)."""
    return int(load().JvllmInt8TileMinRows())


@functools.lru_cache(maxsize=1)
def int8_tile_formats() -> frozenset[str]:
    """The block formats that take 8-bit activations from int8_tile_min_rows rows on this machine's kernel build:
    Q4_0 / Q4_1 (as rows, word groups) and Q4_K / Q5_K with AVX-512 VNNI, the x8-interleaved Q4_0 / Q4_1 with AVX2."""
    mask = int(load().JvllmInt8TileFormats())
    return frozenset(name for name, (code, _, _) in FORMATS.items() if mask >> code & 1)


def quantized_matmul(x: jax.Array, weight: jax.Array, fmt: str, int16_max_rows: int = 0,
                     int16_tile_min_rows: int = 0, live_rows: jax.Array | None = None,
                     bf16_max_rows: int = 0, bf16_min_rows: int = 2, int8_tile_min_rows: int = 0,
                     invariant_max_rows: int = 0) -> jax.Array:
    """x [M, K] float, weight [N, K / block weights * block bytes] uint8 (GGUF blocks, one row per output) -> x @ W^T
    [M, N] float32. `live_rows` ([] int32, default M): only the first rows of x are multiplied, the other rows of
    the result are 0 (a step's padding). From `bf16_min_rows` (1 or 2) to `bf16_max_rows` live rows (builds with
    AVX-512 BF16), x and each weight block are rounded to bfloat16 and summed in float32, each row's bits the same
    whatever rows come with it. Up to `int16_max_rows` live rows, and from
    `int16_tile_min_rows` if that is not 0, x is quantized to int16 blocks and multiplied with integer dot products
    (AVX2 builds; within ~3e-5 of the float32 products); other row counts multiply float32 weights dequantized in
    registers or in tiles. From `int8_tile_min_rows` live rows if that is not 0 (AVX-512 VNNI builds; Q4_0, Q4_1,
    Q4_K, Q5_K), x is quantized to int8 per block of 32 and multiplied with 8-bit dot products: each output within
    half a step of x's block scale (max |x| / 254) times the block's sum |d q|. Up to `invariant_max_rows` live
    rows (AVX-512 builds), every output row is computed the same way whatever rows come with it:
    x in int16 blocks, exact int32 block sums, one float32 chain per output (cpu_kernels/invariant_products.h)."""
    return _call("jvllm_quantized_matmul", x, (weight,), fmt, live_rows, int16_max_rows=int16_max_rows,
                 int16_tile_min_rows=int16_tile_min_rows, bf16_max_rows=bf16_max_rows, bf16_min_rows=bf16_min_rows,
                 int8_tile_min_rows=int8_tile_min_rows, invariant_max_rows=invariant_max_rows)


def gated_matmul(x: jax.Array, gate: jax.Array, up: jax.Array, fmt: str, int16_max_rows: int = 0,
                 int16_tile_min_rows: int = 0, live_rows: jax.Array | None = None,
                 bf16_max_rows: int = 0, bf16_min_rows: int = 2, int8_tile_min_rows: int = 0,
                 invariant_max_rows: int = 0) -> jax.Array:
    """silu(x @ G^T) * (x @ U^T) [M, N] float32 for an MLP's gate and up weights G, U [N, row bytes] in format
    `fmt`: the products of `quantized_matmul` (same row paths and numerics), and past the bfloat16 row limit made
    in one pass that writes only the activations."""
    if gate.shape != up.shape:
        raise ValueError(f"gated_matmul: gate {gate.shape} and up {up.shape} weights differ")
    return _call("jvllm_gated_matmul", x, (gate, up), fmt, live_rows, int16_max_rows=int16_max_rows,
                 int16_tile_min_rows=int16_tile_min_rows, bf16_max_rows=bf16_max_rows, bf16_min_rows=bf16_min_rows,
                 int8_tile_min_rows=int8_tile_min_rows, invariant_max_rows=invariant_max_rows)


def _call(target: str, x: jax.Array, weights: tuple[jax.Array, ...], fmt: str, live_rows: jax.Array | None,
          **limits: int) -> jax.Array:
    """The custom call `target` on x [M, K] and weights [N, row bytes] -> [M, N] float32."""
    code, block_weights, block_bytes = FORMATS[fmt]
    m, k = x.shape
    weight = weights[0]
    if k % block_weights or weight.shape[1] != k // block_weights * block_bytes:
        raise ValueError(f"{target}: x [M, {k}] needs whole blocks of {block_weights} weights, "
                         f"{k // block_weights * block_bytes} bytes a row in {fmt}, got {weight.shape}")
    load()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, weight.shape[0]), jnp.float32))
    live = jnp.asarray(m if live_rows is None else live_rows, jnp.int32).reshape(())
    return call(x.astype(jnp.float32), *weights, live, format=np.int64(code),
                **{name: np.int64(value) for name, value in limits.items()})
