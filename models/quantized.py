"""Weights kept in GGUF's quantized blocks: the formats, their dequantization in jnp, and the product with them (the
native CPU kernel on XLA CPU, dequantize-then-dot elsewhere); `quantized_dot` and `dequantized_rows` also take the
per-channel formats of models.channel_quant."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from models.channel_quant import CHANNEL_FORMATS, channel_dot, channel_rows, check_channels
from models.live_rows import live_rows_of


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


FORMATS = {f.name: f for f in (BlockFormat("q8_0", 32, 34), BlockFormat("q4_0", 32, 18), BlockFormat("q4_1", 32, 20),
                               BlockFormat("q4_k", 256, 144), BlockFormat("q5_k", 256, 176),
                               BlockFormat("q6_k", 256, 210))}

# Q8_0, Q4_0 and Q4_1 with the blocks of each group of weight rows interleaved (the same bytes per row): the layouts in
# which the native kernels multiply them fastest. Name -> the row-major format.
# * x8, groups of 8 rows (AVX2 builds: cpu_kernels/interleaved_products.h). Per group and block of 32 weights: the
#   rows' d halves, Q4_1's m halves, then chunks of 16 bytes, chunk q holding bytes 2q, 2q + 1 of each row's codes.
# * x16, groups of 16 rows by code words (AVX-512 builds with BF16: cpu_kernels/word_group_blocks.h). Per group and
#   block: the rows' d halves, Q4_1's m halves, then per 4-byte code word t 64 bytes, each row's code bytes 4t,
#   4t + 2, 4t + 1, 4t + 3 in turn.
INTERLEAVED = {"q8_0x8": "q8_0", "q4_0x8": "q4_0", "q4_1x8": "q4_1",
               "q8_0x16": "q8_0", "q4_0x16": "q4_0", "q4_1x16": "q4_1"}
INTERLEAVED_ROWS = 8
_WORD_ORDER = [0, 2, 1, 3]  # an x16 group's bytes of each row's code word (its own inverse)


def block_format(fmt: str) -> BlockFormat:
    """The BlockFormat of `fmt`, a file's format (FORMATS) or an interleaved one (INTERLEAVED: the same sizes)."""
    return FORMATS[INTERLEAVED.get(fmt, fmt)]


def group_rows(fmt: str) -> int:
    """The weight rows of a group of interleaved format `fmt` (INTERLEAVED): 8 or 16."""
    return int(fmt.rsplit("x", 1)[1])


def _interleaved_parts(fmt: str, shape: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
    """(header bytes, code bytes) of a block of the row-major format behind interleaved `fmt`, the bytes a code unit
    spans in the layout (2, or 4 for x16's words), and (rows a group, groups, blocks a row) of blocks [N, row bytes]
    of that `shape`."""
    codes = 32 if INTERLEAVED[fmt] == "q8_0" else 16
    header, rows = block_format(fmt).block_bytes - codes, group_rows(fmt)
    return header, codes, 2 if rows == 8 else 4, rows, shape[0] // rows, shape[1] // (header + codes)


def interleave_rows(raw: np.ndarray, fmt: str, rows: int = INTERLEAVED_ROWS) -> np.ndarray:
    """Q8_0 / Q4_0 / Q4_1 blocks [N, row bytes] (N a multiple of `rows`, 8 or 16) -> the same weights in format
    `fmt + f"x{rows}"` (INTERLEAVED)."""
    header, codes, unit, rows, groups, blocks = _interleaved_parts(f"{fmt}x{rows}", raw.shape)
    if unit == 2:  # every half and code unit is one 16-bit word: each block of a group is a [rows, words] transpose
        words = np.ascontiguousarray(raw).view(np.uint16).reshape(groups, rows, blocks, (header + codes) // 2)
        return np.ascontiguousarray(words.transpose(0, 2, 3, 1)).view(np.uint8).reshape(raw.shape)
    by_block = raw.reshape(groups, rows, blocks, header + codes).transpose(0, 2, 1, 3)  # [G, B, rows, bytes]
    halves = by_block[..., :header].reshape(groups, blocks, rows, header // 2, 2).transpose(0, 1, 3, 2, 4)
    units = by_block[..., header:].reshape(groups, blocks, rows, codes // unit, unit)
    if unit == 4:
        units = units[..., _WORD_ORDER]
    units = units.transpose(0, 1, 3, 2, 4)
    out = np.concatenate([halves.reshape(groups, blocks, -1), units.reshape(groups, blocks, -1)], axis=-1)
    return np.ascontiguousarray(out.reshape(raw.shape))


def _rows_of_interleaved(raw: jax.Array, fmt: str) -> jax.Array:
    """Interleaved blocks [N, row bytes] (INTERLEAVED) -> the row-major blocks of the same weights."""
    header, codes, unit, rows, groups, blocks = _interleaved_parts(fmt, raw.shape)
    by_block = raw.reshape(groups, blocks, rows * (header + codes))
    halves = by_block[..., :rows * header].reshape(groups, blocks, header // 2, rows, 2)
    units = by_block[..., rows * header:].reshape(groups, blocks, codes // unit, rows, unit)
    if unit == 4:
        units = units[..., jnp.asarray(_WORD_ORDER)]
    out = jnp.concatenate([halves.transpose(0, 1, 3, 2, 4).reshape(groups, blocks, rows, header),
                           units.transpose(0, 1, 3, 2, 4).reshape(groups, blocks, rows, codes)], axis=-1)
    return out.transpose(0, 2, 1, 3).reshape(raw.shape)


def native_layout(blocks: jax.Array, fmt: str, table: bool = False) -> tuple[jax.Array, str]:
    """A projection's GGUF blocks [N, row bytes] -> (blocks, format) in the layout the native kernels here multiply
    fastest: Q8_0 / Q4_0 / Q4_1 interleaved by groups of 8 rows on AVX2 builds, by code words for 16 rows on AVX-512
    builds with BF16 (INTERLEAVED), anything else as given. A `table` (an embedding table, which a tied LM head
    multiplies; its lookups gather rows from the groups: dequantized_rows) takes only the word groups."""
    if fmt + "x8" not in INTERLEAVED or jax.default_backend() != "cpu" or not native_kernel_available():
        return blocks, fmt
    from cpu_kernels.quantized_matmul import interleaved_rows_preferred, word_groups_preferred

    rows = 16 if word_groups_preferred() else INTERLEAVED_ROWS if interleaved_rows_preferred() and not table else 0
    if not rows or blocks.shape[0] % rows:
        return blocks, fmt
    return jnp.asarray(interleave_rows(np.asarray(blocks), fmt, rows)), f"{fmt}x{rows}"


def _interleaved_row_bytes(fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """For blocks [N, row bytes] of interleaved `fmt`: where each byte of a row-major block lies in its group's block,
    per row of the group -> offsets [rows a group, block bytes] int32."""
    header, codes, unit, rows, _, _ = _interleaved_parts(fmt, shape)
    lane = np.arange(rows)[:, None]
    h = np.arange(header)
    header_at = h // 2 * 2 * rows + 2 * lane + h % 2  # [rows, header]: half h // 2 of each row, one after another
    j = np.arange(codes)
    within = np.asarray(_WORD_ORDER)[j % unit] if unit == 4 else j % unit
    codes_at = header * rows + j // unit * unit * rows + unit * lane + within  # [rows, codes]
    return np.concatenate([header_at, codes_at], axis=1).astype(np.int32)


def check_blocks(blocks: jax.Array, rows: int, k: int, fmt: str, what: str) -> None:
    """ValueError unless `blocks` holds `rows` rows of `k` weights in format `fmt` ([rows, row bytes] uint8; FORMATS or
    INTERLEAVED)."""
    expected = (rows, block_format(fmt).row_bytes(k))
    if fmt in INTERLEAVED and rows % group_rows(fmt):
        raise ValueError(f"{fmt} blocks of {what} come in groups of {group_rows(fmt)} rows, got {rows} rows")
    if tuple(blocks.shape) != expected or blocks.dtype != jnp.uint8:
        raise ValueError(f"{fmt} blocks of {what} are uint8 {expected}, got {blocks.dtype} {tuple(blocks.shape)}")


def _halves(pair: jax.Array) -> jax.Array:
    """[..., 2] uint8, little-endian IEEE half -> [...] float32."""
    bits = pair[..., 0].astype(jnp.uint16) | (pair[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(packed: jax.Array) -> jax.Array:
    """[..., 16] uint8 -> [..., 32] float32: the low nibbles (elements 0-15), then the high ones (16-31)."""
    return jnp.concatenate([packed & 15, packed >> 4], axis=-1).astype(jnp.float32)


def _scale_min_k(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., 12] uint8, a Q4_K/Q5_K block's packed 6-bit scales and mins -> two [..., 8] float32."""
    low, high, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = jnp.concatenate([low & 63, (both & 15) | ((low >> 6) << 4)], axis=-1)
    mins = jnp.concatenate([high & 63, (both >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(jnp.float32), mins.astype(jnp.float32)


def _dequantize_k(blocks: jax.Array, fmt: str) -> jax.Array:
    """[..., B, bytes] K-quant blocks -> float32 [..., B, 8, 32] (sub-blocks of 32 weights)."""
    lead = blocks.shape[:-1]
    if fmt == "q6_k":
        ql = blocks[..., 0:128].reshape(*lead, 2, 1, 2, 32)  # [.., 128-weight half, -, 32-byte part, l]
        low = (ql >> jnp.asarray([0, 4], jnp.uint8).reshape(2, 1, 1)) & 15  # [.., half, nibble, part, l]
        qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
        high = (qh >> jnp.asarray([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 3  # [.., half, 4, l]
        q = (low.reshape(*lead, 2, 4, 32) | (high << 4)).astype(jnp.int32) - 32
        scales = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)  # [.., 16]
        d = _halves(blocks[..., 208:210])[..., None] * scales  # [.., 16] one per 16 weights
        return (d.reshape(*lead, 16, 1) * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, 8, 32)
    scales, mins = _scale_min_k(blocks[..., 4:16])
    d = (_halves(blocks[..., 0:2])[..., None] * scales)[..., None]  # [.., 8, 1]
    dm = (_halves(blocks[..., 2:4])[..., None] * mins)[..., None]
    start = 48 if fmt == "q5_k" else 16
    qs = blocks[..., start:start + 128].reshape(*lead, 4, 1, 32)
    q = ((qs >> jnp.asarray([0, 4], jnp.uint8).reshape(2, 1)) & 15).reshape(*lead, 8, 32)  # sub-block 2i + nibble
    if fmt == "q5_k":
        qh = blocks[..., 16:48].reshape(*lead, 1, 32)
        q = q | (((qh >> jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)) & 1) << 4)
    return d * q.astype(jnp.float32) - dm


def check_quantized(raw: jax.Array, scale: jax.Array | None, rows: int, k: int, fmt: str, what: str) -> bool:
    """ValueError unless `raw` holds [rows, k] weights in format `fmt`: GGUF blocks [rows, row bytes], or per-channel
    codes [rows, k] with `scale` [rows]; -> whether the format is per-channel (it then needs its scale)."""
    if fmt in CHANNEL_FORMATS:
        check_channels(raw, scale, rows, k, fmt, what)
        return True
    check_blocks(raw, rows, k, fmt, what)
    return False


def dequantize(raw: jax.Array, fmt: str, k: int) -> jax.Array:
    """raw [..., row_bytes] uint8, rows of `k` weights in format `fmt` -> float32 [..., k] (interleaved formats: raw
    [N, row_bytes])."""
    if fmt in INTERLEAVED:
        raw, fmt = _rows_of_interleaved(raw, fmt), INTERLEAVED[fmt]
    spec = FORMATS[fmt]
    blocks = raw.reshape(*raw.shape[:-1], k // spec.block_size, spec.block_bytes)  # [..., B, bytes]
    if spec.block_size == 256:
        return _dequantize_k(blocks, fmt).reshape(*raw.shape[:-1], k)
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


def native_cpu_kernels() -> bool:
    """Whether this process runs on XLA CPU with the native kernels built (cpu_kernels)."""
    return jax.default_backend() == "cpu" and native_kernel_available()


def native_float32(*arrays: jax.Array) -> bool:
    """Whether float32 kernels of cpu_kernels can take `arrays`: native_cpu_kernels() and every array float32."""
    return all(a.dtype == jnp.float32 for a in arrays) and native_cpu_kernels()


def invariant_block_rows_available() -> bool:
    """Whether the native kernels here give each row of a product with GGUF blocks the bits it would get alone, up
    to invariant_step_rows, whatever the engine asks (where `batch_invariant` is on by default): AVX-512 builds
    through the invariant path, AVX2 builds through the int16 row path, which multiplies every row alone."""
    return _native_invariant_rows() > 0


# The most rows a step takes on the invariant path: to 16 rows its products cost what the bf16 rows and tiles do
# (on the 2-core Zen 5 VM), past 16 up to 1.16x (32 rows) and the attention's direct loops twice its tiles; suffix
# decoding gained as much with 16 as with 32 (docs/design/speculative_decoding.md).
INVARIANT_PATH_ROWS = 16


def _native_invariant_rows() -> int:
    """The most rows of a product with GGUF blocks whose every row the native kernels here multiply as if alone:
    INVARIANT_PATH_ROWS on the invariant path (AVX-512 builds), the int16 row path's limit on builds without it
    (AVX2: 8), 0 without native kernels."""
    if jax.default_backend() != "cpu" or not native_kernel_available():
        return 0
    from cpu_kernels.quantized_matmul import invariant_max_rows, row_path_limits

    return min(invariant_max_rows(), INVARIANT_PATH_ROWS) or row_path_limits()[0]


def invariant_step_rows(formats: Iterable[str]) -> int:
    """The most token rows of a step whose every row gets the bits it would get alone, for a model with GGUF blocks
    of `formats` on the native kernels: _native_invariant_rows where every weight is in GGUF blocks (FORMATS or
    INTERLEAVED: the invariant path takes them all, and the attention's direct loops then go as far), else 8 (no
    blocks, or a per-channel format)."""
    from cpu_kernels.quantized_matmul import bf16_max_rows

    rows, formats = bf16_max_rows() or 8, set(formats)
    if formats and formats <= FORMATS.keys() | INTERLEAVED.keys():
        rows = _native_invariant_rows() or rows
    return rows


# How a product's live token rows (models.live_rows: padding rows are skipped) meet the blocks depends on their
# count, at limits the kernel build picks for its machine (cpu_kernels.quantized_matmul.row_path_limits and
# bf16_max_rows): on CPUs with AVX-512 BF16, 2+ rows in bfloat16
# (like a float model's batched bf16 weights: rows to 8, bf16 weight tiles beyond) unless bf16_products(False) is in
# effect; otherwise few rows multiply with activations quantized to int16 blocks, each weight block unpacked once per
# activation row, and more rows unpack the weights once into 16-bit code tiles for all rows (AVX2 builds: float32
# tiles in between). With bf16_products(.., int8_tiles=True) (the engine's batched_weight_dtype="int8"),
# products of 9+ rows with Q4_0, Q4_1, Q4_K and Q5_K blocks take 8-bit activations instead of bfloat16 where the
# build has AVX-512 VNNI, as llama.cpp multiplies them. Before all these, products of up to 16 rows (up to R under
# bf16_products(.., invariant_rows=R); 8 with the 8-bit tiles) with any block format take the invariant
# path where the build has it (AVX-512: int16 activations, exact block sums).
# _BF16_ROWS: whether products with GGUF blocks may take bfloat16 here; _INT8_TILES: whether
# the 8-bit tiles may be taken; _INVARIANT_ROWS: the step rows that must each get their own bits (0: no promise).
_BF16_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("bf16_rows", default=True)
_INT8_TILES: contextvars.ContextVar[bool] = contextvars.ContextVar("int8_tiles", default=False)
_INVARIANT_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("invariant_rows", default=0)


@contextlib.contextmanager
def bf16_products(enabled: bool, invariant_rows: int = 0, int8_tiles: bool = False) -> Iterator[None]:
    """Within: whether products of 2+ rows with GGUF blocks, and the native prefill attention over bfloat16 pages, may
    round their activations to bfloat16 where the CPU has bf16 dot products (jvllm.worker.step_functions sets it
    around a step's layers and head from the engine's batched_weight_dtype); with `invariant_rows` (speculative
    decoding: a verification step's rows give the decode steps' tokens; invariant_step_rows), steps of up to that
    many rows give each row the bits it would get alone: products of up to that many rows on the invariant path,
    sequences of up to that many queries through the attention's direct loops; with `int8_tiles` (and `enabled`),
    products of 9+ rows with 4- and 5-bit blocks in 8 bits."""
    token = _BF16_ROWS.set(enabled)
    int8_token = _INT8_TILES.set(int8_tiles)
    invariant_token = _INVARIANT_ROWS.set(invariant_rows)
    try:
        yield
    finally:
        _INVARIANT_ROWS.reset(invariant_token)
        _INT8_TILES.reset(int8_token)
        _BF16_ROWS.reset(token)


def bf16_products_enabled() -> bool:
    """Whether bf16_products(True) (the default) is in effect here."""
    return _BF16_ROWS.get()


def invariant_rows() -> int:
    """The step rows that must each get the bits they would get alone here (bf16_products; 0: none)."""
    return _INVARIANT_ROWS.get()


def kernel_row_limits() -> dict[str, int]:
    """The row limits of the kernels' products here: bfloat16 rows and tiles, 8-bit tiles for products of 9+ rows
    with 4- and 5-bit blocks where the build has them (bf16_products(True, int8_tiles=True)), and the invariant
    path's rows: INVARIANT_PATH_ROWS, or the invariant rows asked for (bf16_products(.., invariant_rows=R)), or 8
    where the 8-bit tiles take 9+ rows. The invariant path runs without a promise too: up to 16 rows it is as fast
    as the other paths or faster, and more precise than bfloat16 (docs/design/speculative_decoding.md)."""
    from cpu_kernels.quantized_matmul import bf16_max_rows, int8_tile_min_rows

    enabled = bf16_products_enabled()
    int8_tiles = enabled and _INT8_TILES.get()
    invariant = _INVARIANT_ROWS.get()
    if invariant <= 8:
        invariant = 8 if int8_tiles else INVARIANT_PATH_ROWS
    return dict(bf16_max_rows=bf16_max_rows() if enabled else 0, bf16_min_rows=2,
                int8_tile_min_rows=int8_tile_min_rows() if int8_tiles else 0, invariant_max_rows=invariant)


def quantized_dot(x: jax.Array, raw: jax.Array, fmt: str, scale: jax.Array | None = None) -> jax.Array:
    """x [T, K] with weights raw [N, row_bytes] (one GGUF row per output) -> x @ W^T [T, N] float32. A per-channel
    format (models.channel_quant) takes codes raw [N, K] and their scales [N] instead."""
    if fmt in CHANNEL_FORMATS:
        return channel_dot(x, raw, scale)
    if native_cpu_kernels():
        from cpu_kernels.quantized_matmul import quantized_matmul, row_path_limits

        return quantized_matmul(x, raw, fmt, *row_path_limits(), live_rows_of(x.shape[0]),
                                **kernel_row_limits())
    w = dequantize(raw, fmt, x.shape[-1])  # [N, K]
    return jnp.einsum("tk,nk->tn", x.astype(jnp.float32), w, preferred_element_type=jnp.float32)


def quantized_gated_dot(x: jax.Array, gate: jax.Array, up: jax.Array, fmt: str) -> jax.Array | None:
    """silu(x @ G^T) * (x @ U^T) [T, N] float32 for an MLP's gate and up GGUF blocks [N, row bytes] in one native
    call (cpu_kernels.quantized_matmul.gated_matmul: past the bf16 row limit one pass that writes only the
    activations); None where the native kernel does not run (other backends, per-channel formats), where the
    caller makes the two products apart."""
    if fmt in CHANNEL_FORMATS or jax.default_backend() != "cpu" or not native_kernel_available():
        return None
    from cpu_kernels.quantized_matmul import gated_matmul, row_path_limits

    return gated_matmul(x, gate, up, fmt, *row_path_limits(), live_rows_of(x.shape[0]),
                        **kernel_row_limits())


def dequantized_rows(raw: jax.Array, ids: jax.Array, fmt: str, k: int, scale: jax.Array | None = None) -> jax.Array:
    """Rows `ids` [T] of a quantized table raw [V, row_bytes] (per-channel: codes [V, k], scales [V]) -> float32
    [T, k] (an embedding lookup)."""
    if fmt in CHANNEL_FORMATS:
        return channel_rows(raw, scale, ids)
    if fmt in INTERLEAVED:  # each row's bytes gathered from its group's blocks, as row-major blocks
        rows, block_bytes = group_rows(fmt), block_format(fmt).block_bytes
        groups = raw.reshape(raw.shape[0] // rows, -1, rows * block_bytes)  # [G, B, group block bytes]
        at = jnp.asarray(_interleaved_row_bytes(fmt, raw.shape))[ids % rows]  # [T, block bytes]
        blocks = groups[(ids // rows)[:, None, None], jnp.arange(groups.shape[1])[None, :, None], at[:, None, :]]
        return dequantize(blocks.reshape(ids.shape[0], -1), INTERLEAVED[fmt], k)  # blocks [T, B, block bytes]
    return dequantize(raw[ids], fmt, k)


def quantize_reference(weights: np.ndarray, fmt: str) -> np.ndarray:
    """float [N, K] -> its GGUF blocks [N, row_bytes] uint8, as llama.cpp's converter writes them (tests, dummy
    quantized weights; gguf's Python package quantizes the 32-weight formats, models.quantize_k the K-quants)."""
    import gguf

    if FORMATS[fmt].block_size == 256:
        from models.quantize_k import quantize_k

        return quantize_k(weights, fmt)

    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    raw = gguf.quants.quantize(np.ascontiguousarray(weights, dtype=np.float32), qtype)
    return np.asarray(raw, dtype=np.uint8).reshape(weights.shape[0], -1)


def random_blocks(rows: int, k: int, fmt: str, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Blocks [rows, row bytes] uint8 of random weights of about `scale` in format `fmt`: random codes with every
    block's half-precision scales set (dummy quantized weights, K-quant test data)."""
    spec = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, k // spec.block_size, spec.block_bytes), dtype=np.uint8)
    step = np.float16(scale / (8 if fmt in ("q4_0", "q4_1") else 128 if fmt == "q8_0" else 512))
    half = np.frombuffer(step.tobytes(), np.uint8)
    if fmt == "q6_k":  # d at the end; int8 sub-scales make up the rest
        raw[..., 208:210] = np.frombuffer(np.float16(scale / 1024).tobytes(), np.uint8)
    else:
        raw[..., 0:2] = half
    if fmt == "q4_1" or fmt in ("q4_k", "q5_k"):  # the min / dmin: centre the weights
        raw[..., 2:4] = np.frombuffer(np.float16(-scale if fmt == "q4_1" else scale / 32).tobytes(), np.uint8)
    return raw.reshape(rows, -1)
