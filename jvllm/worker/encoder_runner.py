"""The vision encoder's device side: its weights, the encoder-output buffer the model steps read image embeddings
from, and the encode steps, one compiled executable per encoder step shape (like the model's step shapes).

LLaVA's images all have one size: a step encodes a batch of them. Qwen2-VL's vary: a step packs images' patches
back to back into one of a few bucketed patch counts, each image attending only to itself."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.core.encoder_cache import EncoderCache, MultiModalItem
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.executable_memo import compile_once
from jvllm.worker.step_shapes import StepShape
from models.qwen2_vl import vision_rotary_positions

MIN_PACKED_TOKENS = 16  # the smallest Qwen2-VL encoder step, in image tokens


class EncoderRunner:
    """Runs the vision encoder on scheduled images and writes their features into the buffer rows the
    EncoderCache gave them; model steps gather those rows (jvllm.worker.step_functions). Subclasses say how
    items become the arrays of one step."""

    def __init__(self, vision: Any, cache: EncoderCache, activation_dtype: Any):
        """`vision`: a jvllm.model_loader.vision.VisionModel."""
        self.cache = cache
        self.weights, treedef = jax.tree.flatten(vision.state)
        graphdef = vision.graphdef
        self.buffer = jnp.zeros((cache.num_rows, vision.config.text_hidden_size), activation_dtype)  # [R, D]

        def encode_into(weights: list[jax.Array], buffer: jax.Array, rows: jax.Array, *inputs: jax.Array) -> jax.Array:
            """rows [N] int32, the encoder's inputs -> the buffer with the N feature rows written there."""
            features = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))(*inputs)
            return buffer.at[rows].set(features.reshape(rows.shape[0], -1).astype(buffer.dtype))

        self._encode_into = jax.jit(encode_into, donate_argnums=(1,))
        self._compiled: dict[StepShape, Any] = {}

    def step_shapes(self) -> list[StepShape]:
        raise NotImplementedError

    def input_specs(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        """The step's rows and encoder inputs, as `encode_into` takes them after the buffer."""
        raise NotImplementedError

    def precompile(self, progress: Any = None) -> None:
        with compile_watch().expected():
            for shape in self.step_shapes():
                self._executable(shape)
                if progress is not None:
                    progress.update(1)

    def _executable(self, shape: StepShape) -> Any:
        if shape not in self._compiled:
            lowered = self._encode_into.lower(self.weights, self.buffer, *self.input_specs(shape))
            self._compiled[shape] = compile_once(lowered)
        return self._compiled[shape]

    def _run(self, shape: StepShape, rows: np.ndarray, *inputs: np.ndarray) -> None:
        with compile_watch().running(shape):
            if shape not in self._compiled:
                with compile_watch().expected():  # precompiling was skipped
                    self._executable(shape)
            self.buffer = self._compiled[shape](self.weights, self.buffer, rows, *inputs)

    def _padding_rows(self, count: int) -> np.ndarray:
        """[count] int32 rows in the reserved block, which no token reads: where padded outputs are written."""
        return np.arange(count, dtype=np.int32) % self.cache.block_rows

    def encode(self, items: list[MultiModalItem]) -> None:
        raise NotImplementedError


class BatchEncoderRunner(EncoderRunner):
    """Images of one fixed size (LLaVA), encoded in batches of the compiled batch sizes (fewer images are padded,
    more split)."""

    def __init__(self, vision: Any, cache: EncoderCache, activation_dtype: Any, batch_sizes: tuple[int, ...] = (1,)):
        super().__init__(vision, cache, activation_dtype)
        self.tokens_per_image = vision.tokens_per_image
        self.pixel_shape = vision.input_shape(self.tokens_per_image)  # [C, H, W]
        self.batch_sizes = tuple(sorted(batch_sizes))

    def step_shapes(self) -> list[StepShape]:
        """One encoder step per batch size: `tokens` feature rows of `seqs` images."""
        return [StepShape("encoder", b * self.tokens_per_image, b) for b in self.batch_sizes]

    def input_specs(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct((shape.tokens,), jnp.int32),
                jax.ShapeDtypeStruct((shape.seqs, *self.pixel_shape), jnp.float32)]

    def encode(self, items: list[MultiModalItem]) -> None:
        """Encode every item (distinct hashes) into its rows."""
        pending = list(items)
        n = self.tokens_per_image
        while pending:
            size = next((b for b in self.batch_sizes if b >= len(pending)), self.batch_sizes[-1])
            batch, pending = pending[:size], pending[size:]
            pixels = np.zeros((size, *self.pixel_shape), np.float32)  # [B, C, H, W]
            rows = self._padding_rows(size * n)
            for index, item in enumerate(batch):
                pixels[index] = item.data
                rows[index * n:(index + 1) * n] = self.cache.item_rows(item.hash)
            self._run(StepShape("encoder", size * n, size), rows, pixels)


class PackedEncoderRunner(EncoderRunner):
    """Images of any size (Qwen2-VL): their patches packed back to back into a step of T image tokens (T x merge
    unit patches), T one of a few buckets up to the largest image; `seqs` is 1, the one packed sequence."""

    def __init__(self, vision: Any, cache: EncoderCache, activation_dtype: Any):
        super().__init__(vision, cache, activation_dtype)
        cfg = vision.config.vision
        self.merge, self.merge_unit, self.patch_dim = cfg.spatial_merge_size, cfg.merge_unit, cfg.patch_dim
        self.buckets = token_buckets(vision.max_image_tokens)

    def step_shapes(self) -> list[StepShape]:
        return [StepShape("encoder", tokens, 1) for tokens in self.buckets]

    def input_specs(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        patches = shape.tokens * self.merge_unit
        return [jax.ShapeDtypeStruct((shape.tokens,), jnp.int32),
                jax.ShapeDtypeStruct((patches, self.patch_dim), jnp.float32),
                jax.ShapeDtypeStruct((patches, 2), jnp.int32), jax.ShapeDtypeStruct((patches,), jnp.int32)]

    def encode(self, items: list[MultiModalItem]) -> None:
        """Encode every item (distinct hashes) into its rows, as few steps as the largest bucket allows."""
        for pack in _packs(items, self.buckets[-1]):
            tokens = next(b for b in self.buckets if b >= sum(item.length for item in pack))
            patches = np.zeros((tokens * self.merge_unit, self.patch_dim), np.float32)  # [P, patch_dim]
            hw_positions = np.zeros((tokens * self.merge_unit, 2), np.int32)  # [P, 2]
            segments = np.full(tokens * self.merge_unit, -1, np.int32)  # [P]: the image of each patch, -1 padding
            rows = self._padding_rows(tokens)  # [T]
            cursor = 0
            for index, item in enumerate(pack):
                span = slice(cursor * self.merge_unit, (cursor + item.length) * self.merge_unit)
                patches[span] = item.data
                grid_rows, grid_cols = item.grid
                hw_positions[span] = vision_rotary_positions(grid_rows * self.merge, grid_cols * self.merge,
                                                             self.merge)
                segments[span] = index
                rows[cursor:cursor + item.length] = self.cache.item_rows(item.hash)
                cursor += item.length
            self._run(StepShape("encoder", tokens, 1), rows, patches, hw_positions, segments)


def token_buckets(max_image_tokens: int) -> tuple[int, ...]:
    """Packed encoder step sizes in image tokens: the largest image's, then quarters of it down to
    MIN_PACKED_TOKENS."""
    sizes = [max_image_tokens]
    while sizes[-1] // 4 >= MIN_PACKED_TOKENS:
        sizes.append(sizes[-1] // 4)
    return tuple(sorted(sizes))


def _packs(items: list[MultiModalItem], capacity: int) -> list[list[MultiModalItem]]:
    """Items in order, grouped greedily into packs of at most `capacity` tokens (each item fits one alone)."""
    packs: list[list[MultiModalItem]] = []
    total = capacity
    for item in items:
        if total + item.length > capacity:
            packs.append([])
            total = 0
        packs[-1].append(item)
        total += item.length
    return packs


def encoder_runner(vision: Any, cache: EncoderCache, activation_dtype: Any) -> EncoderRunner:
    """The runner for this vision model's images: fixed-size batches (LLaVA) or packed patches (Qwen2-VL)."""
    runner: Callable[..., EncoderRunner] = BatchEncoderRunner if vision.tokens_per_image else PackedEncoderRunner
    return runner(vision, cache, activation_dtype)
