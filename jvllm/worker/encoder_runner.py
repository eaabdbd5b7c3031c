"""The vision encoder's device side: its weights, the encoder-output buffer the model steps read image embeddings
from, and the encode step (one compiled executable per image batch size, like the model's step shapes)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.core.encoder_cache import EncoderCache, MultiModalItem
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.executable_memo import compile_once
from jvllm.worker.step_shapes import StepShape


class EncoderRunner:
    """Runs the vision encoder on scheduled images and writes their features into the buffer rows the
    EncoderCache gave them; model steps gather those rows (jvllm.worker.step_functions)."""

    def __init__(self, vision: Any, cache: EncoderCache, activation_dtype: Any, batch_sizes: tuple[int, ...] = (1,)):
        """`vision`: a jvllm.model_loader.vision.VisionModel; `batch_sizes`: the image counts of the compiled
        encode steps (a step with fewer images is padded, with more split)."""
        cfg = vision.config
        self.cache = cache
        self.tokens_per_image = cfg.tokens_per_image
        self.pixel_shape = (cfg.vision.num_channels, cfg.vision.image_size, cfg.vision.image_size)
        self.weights, treedef = jax.tree.flatten(vision.state)
        graphdef = vision.graphdef
        self.buffer = jnp.zeros((cache.num_rows, cfg.text_hidden_size), activation_dtype)  # [R, D]
        self.batch_sizes = tuple(sorted(batch_sizes))

        def encode_into(weights: list[jax.Array], buffer: jax.Array, pixel_values: jax.Array,
                        rows: jax.Array) -> jax.Array:
            """pixel_values [B, C, H, W], rows [B * N] int32 -> the buffer with the B images' features there."""
            features = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))(pixel_values)  # [B, N, D]
            return buffer.at[rows].set(features.reshape(rows.shape[0], -1).astype(buffer.dtype))

        self._encode_into = jax.jit(encode_into, donate_argnums=(1,))
        self._compiled: dict[int, Any] = {}

    def step_shapes(self) -> list[StepShape]:
        """One encoder step per batch size: `tokens` feature rows of `seqs` images."""
        return [StepShape("encoder", b * self.tokens_per_image, b) for b in self.batch_sizes]

    def precompile(self, progress: Any = None) -> None:
        with compile_watch().expected():
            for size in self.batch_sizes:
                self._executable(size)
                if progress is not None:
                    progress.update(1)

    def _executable(self, size: int) -> Any:
        if size not in self._compiled:
            pixels = jax.ShapeDtypeStruct((size, *self.pixel_shape), jnp.float32)
            rows = jax.ShapeDtypeStruct((size * self.tokens_per_image,), jnp.int32)
            self._compiled[size] = compile_once(self._encode_into.lower(self.weights, self.buffer, pixels, rows))
        return self._compiled[size]

    def encode(self, items: list[MultiModalItem]) -> None:
        """Encode every item (distinct hashes) into its rows, in batches of the compiled sizes."""
        pending = list(items)
        while pending:
            size = next((b for b in self.batch_sizes if b >= len(pending)), self.batch_sizes[-1])
            batch, pending = pending[:size], pending[size:]
            pixels = np.zeros((size, *self.pixel_shape), np.float32)
            # padded images write into the reserved block, which no token reads
            rows = np.arange(size * self.tokens_per_image, dtype=np.int32) % self.cache.block_rows
            n = self.tokens_per_image
            for index, item in enumerate(batch):
                pixels[index] = item.data
                rows[index * n:(index + 1) * n] = self.cache.item_rows(item.hash)
            shape = StepShape("encoder", size * self.tokens_per_image, size)
            with compile_watch().running(shape):
                if size not in self._compiled:
                    with compile_watch().expected():  # precompiling was skipped
                        self._executable(size)
                self.buffer = self._compiled[size](self.weights, self.buffer, pixels, rows)
