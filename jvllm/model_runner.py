"""Owns the device side: weights, the donated KV page pool, and the jitted bucketed model steps."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.attention import AttendFn, WriteFn, get_backend
from jvllm.attention.metadata import AttentionMetadata
from jvllm.batch import BucketLimits, build_batch
from jvllm.sampler import sample
from jvllm.sampling_tensors import RowSpec, SamplerFlags, SamplingTensors, build_sampling_tensors
from jvllm.scheduler import ScheduledChunk
from models.loader import LoadedModel

logger = logging.getLogger("jvllm")


@functools.partial(jax.jit, static_argnames=("graphdef", "attend", "flags"))
def _forward_and_sample(state: Any, kv_cache: list, input_ids: jax.Array, positions: jax.Array,
                        md: AttentionMetadata, sampling: SamplingTensors, *, graphdef: Any, attend: AttendFn,
                        flags: SamplerFlags):
    """Forward the flat token batch (pool read only), sample each sequence's last position
    -> (ids [S] int32, logprobs [S] float32, per-layer new (k, v) [T, KVH, hd])."""
    model = nnx.merge(graphdef, state)
    hidden, new_kv = model(input_ids, positions, kv_cache, md, attend)  # [T, D]
    logits = model.compute_logits(hidden[md.last_token_index])  # [S, V] float32
    token_ids, logprobs = sample(logits, sampling, flags)
    return token_ids, logprobs, new_kv


@functools.partial(jax.jit, static_argnames=("write",), donate_argnames=("kv_cache",))
def _write_pool(kv_cache: list, new_kv: list, md: AttentionMetadata, *, write: WriteFn) -> list:
    """Scatter a step's K/V into the donated pool, in place."""
    return write(kv_cache, new_kv, md)


@functools.partial(jax.jit, static_argnames=("graphdef", "attend"))
def _all_logits(state: Any, kv_cache: list, input_ids: jax.Array, positions: jax.Array, md: AttentionMetadata,
                *, graphdef: Any, attend: AttendFn) -> jax.Array:
    """Forward and return logits at every token position -> [T, V] float32."""
    model = nnx.merge(graphdef, state)
    hidden, _ = model(input_ids, positions, kv_cache, md, attend)
    return model.compute_logits(hidden)


class ModelRunner:
    """Turns scheduled chunks into device arrays, runs the jitted step, returns sampled ids to the host."""

    def __init__(self, loaded: LoadedModel, *, num_pages: int, page_size: int, limits: BucketLimits,
                 attention_backend: str):
        self.loaded = loaded
        self.page_size = page_size
        self.limits = limits
        self.backend = get_backend(attention_backend)
        cfg = loaded.config
        self.kv_cache = self._new_pool(num_pages)
        self._seen_shapes: set[tuple] = set()
        self.vocab_size = cfg.vocab_size
        logger.info("KV pool: %d pages x %d tokens, %.1f MiB", num_pages, page_size,
                    self.kv_pool_bytes(cfg, loaded.dtype, num_pages, page_size) / 2**20)

    def _new_pool(self, num_pages: int) -> list[tuple[jax.Array, jax.Array]]:
        cfg = self.loaded.config
        shape = (num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)  # [N, page, KVH, hd]
        return [(jnp.zeros(shape, self.loaded.dtype), jnp.zeros(shape, self.loaded.dtype))
                for _ in range(cfg.num_layers)]

    @staticmethod
    def kv_pool_bytes(cfg: Any, dtype: Any, num_pages: int, page_size: int) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * num_pages * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize

    def execute(self, chunks: list[ScheduledChunk]) -> dict[str, tuple[int, float]]:
        """Run decode chunks (1 token) and prefill chunks as two bucketed calls; -> {request_id: (token, logprob)}."""
        results: dict[str, tuple[int, float]] = {}
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        for group in (decodes, prefills):
            if group:
                results.update(self._run_group(group))
        return results

    def _run_group(self, chunks: list[ScheduledChunk]) -> dict[str, tuple[int, float]]:
        batch = build_batch(chunks, self.page_size, self.limits)
        num_rows = batch.metadata.q_lens.shape[0]
        rows = [self._row_spec(c) for c in chunks]
        sampling, flags = build_sampling_tensors(rows, num_rows)
        self._log_new_shape(("step", *batch.shape_key, flags))
        md = jax.device_put(batch.metadata)
        token_ids, logprobs, new_kv = _forward_and_sample(
            self.loaded.state, self.kv_cache, batch.input_ids, batch.positions, md, sampling,
            graphdef=self.loaded.graphdef, attend=self.backend.attend, flags=flags)
        self.kv_cache = _write_pool(self.kv_cache, new_kv, md, write=self.backend.write)
        token_ids, logprobs = np.asarray(token_ids), np.asarray(logprobs)
        return {c.request.request_id: (int(token_ids[i]), float(logprobs[i]))
                for i, c in enumerate(chunks) if c.samples}

    @staticmethod
    def _row_spec(chunk: ScheduledChunk) -> RowSpec:
        request = chunk.request
        params = request.params
        blocked: list[int] = []
        if len(request.output_token_ids) < params.min_tokens:
            blocked = [*params.stop_token_ids, *([] if params.ignore_eos else request.eos_token_ids)]
        return RowSpec(params=params, seed=request.seed, position=request.num_tokens,
                       prompt_ids=request.prompt_token_ids, output_ids=request.output_token_ids, blocked_ids=blocked)

    def _log_new_shape(self, key: tuple) -> None:
        if key not in self._seen_shapes:
            self._seen_shapes.add(key)
            logger.info("compiling/using step shape tokens=%d seqs=%d max_q=%d pages=%d flags=%s", *key[1:5],
                        key[5] if len(key) > 5 else "-")

    @property
    def compiled_shapes(self) -> set[tuple]:
        return set(self._seen_shapes)

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits [T, V] at every position of one prompt, computed through the paged path (one chunk)."""
        n = len(token_ids)
        pages_needed = -(-n // self.page_size)
        page_table = [0] * pages_needed  # nothing cached: the pages are never read, the chunk is attended directly

        class _Prompt:  # the minimal request view build_batch reads
            num_computed_tokens = 0
            num_tokens = n
            page_table: list[int] = []
            token_at = staticmethod(lambda i: token_ids[i])

        fake = _Prompt()
        fake.page_table = page_table
        chunk = ScheduledChunk(fake, n)  # type: ignore[arg-type]
        batch = build_batch([chunk], self.page_size, BucketLimits(max(n, 1), 1, max(pages_needed, 1)))
        started = time.perf_counter()
        logits = _all_logits(self.loaded.state, self.kv_cache, batch.input_ids, batch.positions, batch.metadata,
                             graphdef=self.loaded.graphdef, attend=self.backend.attend)
        logger.debug("prompt_logits for %d tokens took %.2fs", n, time.perf_counter() - started)
        return np.asarray(logits)[:n]
