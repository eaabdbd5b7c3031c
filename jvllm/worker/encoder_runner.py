"""The vision encoder's device side: its weights, the encoder-output buffer the model steps read image embeddings
from, and the encode steps, one compiled executable per encoder step shape (like the model's step shapes).

The engine decides which images a step encodes and at which buffer rows (its EncoderCache, jvllm.core.encoder_cache)
and hands them over as plain EncodeItems; this module turns them into EncoderCalls (numpy inputs of one encoder
step) and runs those. A step's StepCall carries its EncoderCalls, so on several hosts every rank runs the same
encoder steps and fills its buffer alike.

LLaVA's images all have one size: a step encodes a batch of them. Qwen2-VL's vary: a step packs images' patches
back to back into one of a few bucketed patch counts, each image attending only to itself."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jvllm.parallel.mesh import put_replicated, replicated
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.executable_memo import compile_once
from jvllm.worker.step_call import EncoderCall
from jvllm.worker.step_plan import EncodeItem
from jvllm.worker.step_shapes import StepShape
from models.qwen2_vl import vision_rotary_positions

MIN_PACKED_TOKENS = 16  # the smallest Qwen2-VL encoder step, in image tokens


@dataclasses.dataclass(frozen=True)
class EncoderBufferLayout:
    """The encoder buffer's rows, as the engine's EncoderCache maps them: `num_rows` in all, the first
    `reserved_rows` read by no token (padded encoder outputs are written there)."""

    num_rows: int
    reserved_rows: int


class EncoderRunner:
    """Runs the vision encoder's steps, each writing its images' features into the buffer rows the engine chose;
    model steps gather those rows (jvllm.worker.step_functions). With a mesh (tensor parallelism) the vision
    weights and the buffer are replicated on every device, and every device encodes. Subclasses say how a step's
    EncodeItems become EncoderCalls."""

    def __init__(self, vision: Any, layout: EncoderBufferLayout, activation_dtype: Any, mesh: Mesh | None = None):
        """`vision`: a jvllm.model_loader.vision.VisionModel."""
        self.reserved_rows = layout.reserved_rows
        self.mesh = mesh
        self._whole = None if mesh is None else replicated(mesh)
        leaves, treedef = jax.tree.flatten(vision.state)
        self.weights = leaves if mesh is None else put_replicated(leaves, mesh)
        graphdef = vision.graphdef
        shape = (layout.num_rows, vision.config.text_hidden_size)
        if mesh is None:
            self.buffer = jnp.zeros(shape, activation_dtype)  # [R, D]
        else:
            self.buffer = jax.jit(lambda: jnp.zeros(shape, activation_dtype), out_shardings=self._whole)()  # [R, D]

        def encode_into(weights: list[jax.Array], buffer: jax.Array, rows: jax.Array, *inputs: jax.Array) -> jax.Array:
            """rows [N] int32, the encoder's inputs -> the buffer with the N feature rows written there."""
            features = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))(*inputs)
            return buffer.at[rows].set(features.reshape(rows.shape[0], -1).astype(buffer.dtype))

        sharded = {} if mesh is None else {"out_shardings": self._whole}
        self._encode_into = jax.jit(encode_into, donate_argnums=(1,), **sharded)
        self._compiled: dict[StepShape, Any] = {}

    def step_shapes(self) -> list[StepShape]:
        raise NotImplementedError

    def input_specs(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        """The step's rows and encoder inputs, as `encode_into` takes them after the buffer."""
        raise NotImplementedError

    def calls(self, items: Sequence[EncodeItem]) -> list[EncoderCall]:
        """The encoder steps that encode every item (distinct images) into its rows."""
        raise NotImplementedError

    def _spec(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        """An input of the encoder step: replicated on the mesh, if any."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._whole)

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

    def run(self, call: EncoderCall) -> None:
        """Run one encoder step: its features land in the buffer (which it takes donated)."""
        args: Any = (call.rows, *call.inputs)
        if self.mesh is not None:
            args = put_replicated(args, self.mesh)
        with compile_watch().running(call.shape):
            if call.shape not in self._compiled:
                with compile_watch().expected():  # precompiling was skipped
                    self._executable(call.shape)
            self.buffer = self._compiled[call.shape](self.weights, self.buffer, *args)

    def _padding_rows(self, count: int) -> np.ndarray:
        """[count] int32 rows in the reserved block, which no token reads: where padded outputs are written."""
        return np.arange(count, dtype=np.int32) % self.reserved_rows


class BatchEncoderRunner(EncoderRunner):
    """Images of one fixed size (LLaVA), encoded in batches of the compiled batch sizes (fewer images are padded,
    more split)."""

    def __init__(self, vision: Any, layout: EncoderBufferLayout, activation_dtype: Any, mesh: Mesh | None = None,
                 batch_sizes: tuple[int, ...] = (1,)):
        super().__init__(vision, layout, activation_dtype, mesh)
        self.tokens_per_image = vision.tokens_per_image
        self.pixel_shape = vision.input_shape(self.tokens_per_image)  # [C, H, W]
        self.batch_sizes = tuple(sorted(batch_sizes))

    def step_shapes(self) -> list[StepShape]:
        """One encoder step per batch size: `tokens` feature rows of `seqs` images."""
        return [StepShape("encoder", b * self.tokens_per_image, b) for b in self.batch_sizes]

    def input_specs(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        return [self._spec((shape.tokens,), jnp.int32), self._spec((shape.seqs, *self.pixel_shape), jnp.float32)]

    def calls(self, items: Sequence[EncodeItem]) -> list[EncoderCall]:
        pending = list(items)
        n = self.tokens_per_image
        calls = []
        while pending:
            size = next((b for b in self.batch_sizes if b >= len(pending)), self.batch_sizes[-1])
            batch, pending = pending[:size], pending[size:]
            pixels = np.zeros((size, *self.pixel_shape), np.float32)  # [B, C, H, W]
            rows = self._padding_rows(size * n)  # [B x n]
            for index, item in enumerate(batch):
                pixels[index] = item.data
                rows[index * n:(index + 1) * n] = item.rows
            calls.append(EncoderCall(StepShape("encoder", size * n, size), rows, (pixels,)))
        return calls


class PackedEncoderRunner(EncoderRunner):
    """Images of any size (Qwen2-VL): their patches packed back to back into a step of T image tokens (T x merge
    unit patches), T one of a few buckets up to the largest image; `seqs` is 1, the one packed sequence."""

    def __init__(self, vision: Any, layout: EncoderBufferLayout, activation_dtype: Any, mesh: Mesh | None = None):
        super().__init__(vision, layout, activation_dtype, mesh)
        cfg = vision.config.vision
        self.merge, self.merge_unit, self.patch_dim = cfg.spatial_merge_size, cfg.merge_unit, cfg.patch_dim
        self.buckets = token_buckets(vision.max_image_tokens)

    def step_shapes(self) -> list[StepShape]:
        return [StepShape("encoder", tokens, 1) for tokens in self.buckets]

    def input_specs(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        patches = shape.tokens * self.merge_unit
        return [self._spec((shape.tokens,), jnp.int32), self._spec((patches, self.patch_dim), jnp.float32),
                self._spec((patches, 2), jnp.int32), self._spec((patches,), jnp.int32)]

    def calls(self, items: Sequence[EncodeItem]) -> list[EncoderCall]:
        """As few steps as the largest bucket allows."""
        calls = []
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
                rows[cursor:cursor + item.length] = item.rows
                cursor += item.length
            calls.append(EncoderCall(StepShape("encoder", tokens, 1), rows, (patches, hw_positions, segments)))
        return calls


def token_buckets(max_image_tokens: int) -> tuple[int, ...]:
    """Packed encoder step sizes in image tokens: the largest image's, then quarters of it down to
    MIN_PACKED_TOKENS."""
    sizes = [max_image_tokens]
    while sizes[-1] // 4 >= MIN_PACKED_TOKENS:
        sizes.append(sizes[-1] // 4)
    return tuple(sorted(sizes))


def _packs(items: Sequence[EncodeItem], capacity: int) -> list[list[EncodeItem]]:
    """Items in order, grouped greedily into packs of at most `capacity` tokens (each item fits one alone)."""
    packs: list[list[EncodeItem]] = []
    total = capacity
    for item in items:
        if total + item.length > capacity:
            packs.append([])
            total = 0
        packs[-1].append(item)
        total += item.length
    return packs


def encoder_runner(vision: Any, layout: EncoderBufferLayout, activation_dtype: Any,
                   mesh: Mesh | None = None) -> EncoderRunner:
    """The runner for this vision model's images: fixed-size batches (LLaVA) or packed patches (Qwen2-VL)."""
    runner: Callable[..., EncoderRunner] = BatchEncoderRunner if vision.tokens_per_image else PackedEncoderRunner
    return runner(vision, layout, activation_dtype, mesh)
