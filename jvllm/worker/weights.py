"""The weights a step runs with: the loaded ones, and an optional low-precision copy for steps of many rows."""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from cpu_kernels.build import available as cpu_kernels_available
from cpu_kernels.build import cpu_has_bf16_dots
from jvllm.worker.model_parts import ModelParts, PartWeights, split_model
from models.bf16_rows import bf16_rows_available
from models.layers import is_float_matrix, out_in_kernel_leaves

# Steps of at least this many token rows take the batched (e.g. bf16) copy. XLA CPU runs dots of 2+ rows through
# YNNPACK, where bf16 is faster from 2 rows; a 1-row bf16 dot is a slow matrix-vector product
# (docs/design/bf16_weights.md).
BATCHED_MIN_ROWS = 2

logger = logging.getLogger("jvllm")


AUTO_COPY_MAX_RAM_FRACTION = 0.25  # "auto" adds no copy when the float32 weights take more of the host's memory


def batched_weights_for(requested: Any, dtype: Any, loaded: Any) -> Any:
    """The dtype of the batched weight copy an engine gets (None: no copy).

    `requested` is the engine's `batched_weight_dtype`: None or "none" (no copy), a dtype, or "auto": bfloat16 for a
    generative model in float32 on CPU when its `dtype` was "auto" itself (YNNPACK's bf16 dots run batched steps
    ~1.6x faster than float32 ones), unless weights held in float32 already take a quarter of the host's memory
    (matrices loaded in bf16, matrix_dtype_at_load, are the copy themselves); for an encoder (embeddings, scores)
    likewise, but only where the CPU has bf16 dot products (AVX-512 BF16: there its batches of 512+ tokens embed
    ~1.6x faster; without them XLA's bf16 dots are slower than float32's). "int8"
    is "auto" here (it concerns the products with GGUF blocks: int8_block_products)."""
    from jvllm.model_loader.loader import resolve_dtype

    if requested == "int8":
        requested = "auto"
    if requested is None or requested == "none":
        return None
    if requested != "auto":
        return resolve_dtype(requested)
    if dtype != "auto" or jax.default_backend() != "cpu" or jnp.dtype(loaded.dtype) != jnp.float32:
        return None
    if loaded.is_encoder and not cpu_has_bf16_dots():
        return None
    if any(leaf.dtype.itemsize == 1 for leaf in jax.tree.leaves(loaded.state)):
        return None  # quantized weights (GGUF blocks: the native kernels serve batched steps from the blocks)
    float32_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(loaded.state) if leaf.dtype == jnp.float32)
    if float32_bytes > AUTO_COPY_MAX_RAM_FRACTION * _host_memory_bytes():
        return None
    return jnp.dtype(jnp.bfloat16)


def matrix_dtype_at_load(dtype: Any, requested: Any, *, pooling: str | None, tensor_parallel_size: int) -> Any:
    """bfloat16 where the engine's steps of every row count will read only the bf16 copy of the weight matrices
    (StepWeights.every_step_reads_the_copy), so that a float checkpoint's matrices are loaded in bfloat16 and never
    held in float32: CPU, `dtype` and `batched_weight_dtype` "auto" (or a bf16 copy asked for), one device, the
    native one-row bf16 product, and no pooling (an embedder reads the loaded weights). None otherwise. The loader
    applies it only to decoders it suits (model_loader.float_weights.takes_matrix_dtype)."""
    if dtype != "auto" or jax.default_backend() != "cpu" or tensor_parallel_size != 1 or pooling is not None:
        return None
    if requested in (None, "none") or not bf16_rows_available():
        return None
    if requested not in ("auto", "int8"):
        from jvllm.model_loader.loader import resolve_dtype

        if resolve_dtype(requested) != jnp.bfloat16:
            return None
    return jnp.dtype(jnp.bfloat16)


def bf16_block_products(requested: Any) -> bool:
    """Whether GGUF blocks may multiply 2+ rows in bfloat16 (CPUs with AVX-512 BF16: models.quantized), given the
    engine's `batched_weight_dtype`: yes unless it asks for no batched copy ("none") or for float32."""
    return requested not in (None, "none", "float32")


def batch_invariant_for(requested: bool | None, loaded: Any, attention_backend: str) -> bool:
    """The engine's `batch_invariant` (None: on where it costs nothing: GGUF blocks on the native CPU kernels, whose
    products of up to invariant_step_rows rows give each row its own bits on AVX-512 and AVX2 builds, with attention
    by the native kernel, whose verification rows give decode rows' bits; docs/design/speculative_decoding.md).
    The batched weight dtype does not matter: GGUF blocks get no copy, and their 8-bit tiles (`int8`) take only
    steps past the invariant rows."""
    if requested is not None:
        return requested
    from models.quantized import invariant_block_rows_available

    return (loaded.keeps_blocks and not loaded.is_encoder and attention_backend == "cpu"
            and invariant_block_rows_available())


def block_formats(loaded: Any) -> frozenset[str]:
    """The formats of a model's quantized weights (projections, embedding table, LM head): GGUF block formats, or a
    per-channel format's name."""
    from flax import nnx

    found = set()
    for _, node in nnx.iter_graph(nnx.merge(loaded.graphdef, loaded.state)):
        for name in ("quant", "embed_quant", "head_quant"):
            fmt = getattr(node, name, None)
            if isinstance(fmt, str):
                found.add(fmt)
    return frozenset(found)


def invariant_step_rows_for(loaded: Any) -> int:
    """With batch_invariant, the most token rows a step may hold with each row's bits its own
    (models.quantized.invariant_step_rows: 16 where the native kernels' invariant path takes every format of the
    model, else 8)."""
    from models.quantized import invariant_step_rows

    return invariant_step_rows(block_formats(loaded))


def int8_block_products(requested: Any) -> bool:
    """Whether products of 9+ rows with 4- and 5-bit GGUF blocks take 8-bit activations (CPUs with AVX-512 VNNI, or
    AVX2 for Q4_0 / Q4_1: models.quantized), given the engine's `batched_weight_dtype`: only when it is "int8"
    (llama.cpp's numerics: faster prefill, greedy outputs further from float32's than bfloat16's;
    docs/design/gguf_blocks.md). Asked for where the kernels have no 8-bit tiles, it is logged as having no
    effect."""
    if requested != "int8":
        return False
    if not int8_tiles_here():
        logger.warning("batched_weight_dtype='int8' has no effect here: 8-bit activations need the native CPU "
                       "kernels (x86-64 with AVX2); products keep their float, 16-bit or bfloat16 activations")
    return True


def int8_tiles_here() -> bool:
    """Whether this process's default device is a CPU whose native kernels have 8-bit tiles."""
    if jax.default_backend() != "cpu" or not cpu_kernels_available():
        return False
    from cpu_kernels.quantized_matmul import int8_tile_min_rows

    return int8_tile_min_rows() > 0


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def cast_matrices(weights: list[jax.Array], dtype: Any, out_in: list[bool] | None = None) -> list[jax.Array]:
    """A copy of the weights with every float matrix (ndim >= 2) in `dtype`; norms, biases and quantized weights
    (GGUF blocks, int8 and float8 codes) keep theirs. The leaves flagged in `out_in` (Linear kernels [in, out]) are
    stored transposed, [out, in]."""
    flags = out_in or [False] * len(weights)
    return [(a.T if flip else a).astype(dtype) if is_float_matrix(a) else a for a, flip in zip(weights, flags)]


class StepWeights:
    """The model split into its outer part and layers (jvllm.worker.model_parts); `for_rows(rows)` picks the
    weights of a step with `rows` token rows."""

    def __init__(self, graphdef: Any, state: Any, *, batched_dtype: Any = None, sharded: bool = False,
                 batched_min_rows: int = BATCHED_MIN_ROWS) -> None:
        self.parts: ModelParts
        self.parts, self.weights, outer_state, layer_states = split_model(graphdef, state)
        self.batched_min_rows = batched_min_rows
        # one-token products with bf16 weights by the native kernel: unsharded weights on CPU (models.bf16_rows)
        self.one_row_bf16 = not sharded and bf16_rows_available()
        self.batched: PartWeights | None = None
        self.batched_dtype = None if batched_dtype is None else jnp.dtype(batched_dtype)
        if batched_dtype is not None:
            # The batched copy keeps narrowing projections [out, in] on one CPU device, where YNNPACK multiplies
            # them faster (models.layers.stored_out_in); sharded and GPU weights keep the loaded layout.
            flip = not sharded and jax.default_backend() == "cpu"

            def cast(leaves: list[jax.Array], part_state: Any) -> list[jax.Array]:
                return cast_matrices(leaves, batched_dtype, out_in_kernel_leaves(part_state) if flip else None)

            self.batched = PartWeights(cast(self.weights.outer, outer_state),
                                       [cast(w, s) for w, s in zip(self.weights.layers, layer_states)])
            bf16 = jnp.dtype(batched_dtype) == jnp.bfloat16
            if self.one_row_bf16 and bf16 and not self._stacked_16_bit(self.batched):
                self.batched_min_rows = 1  # one-token steps read the bf16 copy too: half float32's bytes

    @property
    def every_step_reads_the_copy(self) -> bool:
        """Whether steps of every row count take the batched copy, so no step reads the loaded matrices."""
        return self.batched is not None and self.batched_min_rows <= 1

    def drop_loaded(self) -> None:
        """Forget the loaded weights where every step reads the batched copy (their arrays are freed once nothing
        else holds them: LoadedModel.drop_float_matrices)."""
        if not self.every_step_reads_the_copy:
            raise ValueError("steps of some row counts read the loaded weights")
        self.weights = self.batched

    @property
    def arrays(self) -> list[jax.Array]:
        """Every array the steps may read, each once: the loaded weights and the batched copy's own."""
        leaves = self.weights.leaves + ([] if self.batched is None else self.batched.leaves)
        return list({id(a): a for a in leaves}.values())

    def for_rows(self, rows: int) -> PartWeights:
        if self.batched is not None and rows >= self.batched_min_rows:
            return self.batched
        return self.weights

    @property
    def one_row_dots_slow(self) -> bool:
        """XLA CPU multiplies one row by a 16-bit matrix ~10x slower than by a float32 one, and two rows as fast
        as one float32 row: with 16-bit weights for 1-row steps that the native kernel does not take (float16,
        stacked experts, sharded weights), every step should get at least 2 rows."""
        weights = self.for_rows(1)
        sixteen_bit = [w for w in weights.leaves if _float_16_bit(w) and w.ndim >= 2]
        if not sixteen_bit or jax.default_backend() != "cpu":
            return False
        native = self.one_row_bf16 and not self._stacked_16_bit(weights)
        return not native or any(w.dtype != jnp.bfloat16 for w in sixteen_bit)

    @staticmethod
    def _stacked_16_bit(weights: PartWeights) -> bool:
        """Whether 16-bit float weights of rank 3+ (a mixture of experts' stacked projections) are among `weights`:
        the native one-row product takes matrices only."""
        return any(_float_16_bit(w) and w.ndim >= 3 for w in weights.leaves)


def _float_16_bit(w: jax.Array) -> bool:
    return jnp.issubdtype(w.dtype, jnp.floating) and w.dtype.itemsize == 2
