"""Owns the device side: weights, the donated KV page pool, and the jitted bucketed model steps."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention import get_backend
from jvllm.core.scheduler import ScheduledChunk
from jvllm.model_loader.loader import LoadedModel
from jvllm.parallel.mesh import host_array, named_sharding, put_replicated
from jvllm.sample.logprobs import TokenLogprobs, bucket_k, host_rows
from jvllm.sample.tensors import RowSpec, build_sampling_tensors
from jvllm.utils import cdiv
from jvllm.worker.batch import BucketLimits, ChunkRow, build_batch, chunk_rows
from jvllm.worker.step_functions import build_step_functions
from jvllm.worker.weights import BATCHED_MIN_ROWS, StepWeights
from models.attention import AttentionMetadata

logger = logging.getLogger("jvllm")


LONG_CHUNK_TOKENS = 256  # prefill chunks at least this long run as their own group


@dataclasses.dataclass
class StepCall:
    """Everything one device step takes from the host: numpy arrays and static choices. Multi-host, rank 0
    sends it to the other ranks, which run the same step (jvllm.parallel.distributed)."""

    input_ids: np.ndarray | jax.Array  # [T] int32; on the device for a look-ahead step
    positions: np.ndarray  # [T] int32
    metadata: AttentionMetadata  # numpy leaves
    sampling: Any = None  # SamplingTensors (numpy leaves); None for an all-logits call
    prompt_targets: np.ndarray | None = None  # [T] int32
    flags: Any = None  # SamplerFlags
    num_logprobs: int | None = None
    num_prompt_logprobs: int | None = None

    @property
    def all_logits(self) -> bool:
        return self.sampling is None


@dataclasses.dataclass
class StepResult:
    """One chunk's outcome: the sampled token (None for a prompt chunk that does not sample) and, if asked,
    its logprob stats and the prompt logprobs of prompt tokens prompt_start, prompt_start + 1, ..."""

    token_id: int | None
    token_logprobs: TokenLogprobs | None  # the sampled token's logprob, rank and top-k, when the request asked
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    prompt_start: int = 1


@dataclasses.dataclass
class DispatchedGroup:
    """One bucketed device call started by ModelRunner.dispatch; `out` holds its device outputs."""

    chunks: list[ScheduledChunk]
    call: StepCall
    prompt_rows: list
    out: Any


@jax.jit
def _take_ids(source_ids: jax.Array, rows: np.ndarray) -> jax.Array:
    """source_ids [S'] int32, rows [T] int32 -> [T] int32 input ids, gathered on the device."""
    return source_ids[rows]


def prompt_logprob_targets(chunks: list[ScheduledChunk], num_tokens: int) -> tuple[np.ndarray, list]:
    """[T] int32 next-prompt-token targets (-1 elsewhere) and the requests that asked for prompt logprobs."""
    targets = np.full(num_tokens, -1, np.int32)
    wanted = []
    cursor = 0
    for chunk in chunks:
        request = chunk.request
        if request.params.prompt_logprobs is not None and chunk.start < request.num_prompt_tokens - 1:
            wanted.append(request)
            for offset in range(chunk.num_tokens):
                nxt = chunk.start + offset + 1
                if nxt < request.num_prompt_tokens:
                    targets[cursor + offset] = request.prompt_token_ids[nxt]
        cursor += chunk.num_tokens
    return targets, wanted


class ModelRunner:
    """Turns scheduled chunks into device arrays, runs the jitted step, returns sampled ids to the host."""

    def __init__(self, loaded: LoadedModel, *, num_pages: int, page_size: int, limits: BucketLimits,
                 attention_backend: str, batched_weight_dtype: Any = None, batched_min_rows: int = BATCHED_MIN_ROWS,
                 channel: Any = None):
        """`channel` (multi-host, a jvllm.parallel.distributed.StepChannel): rank 0 sends every step's
        StepCall through it before running it; the other ranks run what they receive."""
        self.loaded = loaded
        self.page_size = page_size
        self.mesh = loaded.mesh
        self.channel = channel
        self.backend = get_backend(attention_backend)
        self.step_weights = StepWeights(loaded.state, batched_dtype=batched_weight_dtype,
                                        sharded=self.mesh is not None, batched_min_rows=batched_min_rows)
        self.steps = build_step_functions(loaded.graphdef, self.step_weights.treedef, self.backend, self.mesh,
                                          loaded.config.vocab_size)
        self.limits = dataclasses.replace(limits, min_rows=2) if self.step_weights.one_row_dots_slow else limits
        cfg = loaded.config
        self.kv_cache = self._new_pool(num_pages)
        self._seen_shapes: set[tuple] = set()
        self.vocab_size = cfg.vocab_size
        logger.info("KV pool: %d pages x %d tokens, %.1f MiB", num_pages, page_size,
                    self.kv_pool_bytes(cfg, loaded.dtype, num_pages, page_size) / 2**20)

    @property
    def weights(self) -> list[jax.Array]:
        return self.step_weights.weights

    @property
    def batched_weights(self) -> list[jax.Array] | None:
        return self.step_weights.batched

    def _new_pool(self, num_pages: int) -> list[tuple[jax.Array, jax.Array]]:
        """Every layer's zeroed K and V pages from one jitted call (faster than one eager zeros per array)."""
        cfg = self.loaded.config
        shape = (num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)  # [N, page, KVH, hd]
        sharding = None if self.mesh is None else named_sharding(  # each device makes only its KV heads
            self.mesh, ("pages", "page_slot", "kv_heads", "head_dim"))
        dtype = self.backend.pool_dtype(self.loaded.dtype)
        zeros = jax.jit(lambda: [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)],
                        out_shardings=sharding)
        return zeros()

    @staticmethod
    def kv_pool_bytes(cfg: Any, dtype: Any, num_pages: int, page_size: int) -> int:
        """The whole pool, all devices together (each holds num_kv_heads / tp of the heads)."""
        return 2 * cfg.num_layers * cfg.num_kv_heads * num_pages * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize

    @property
    def can_look_ahead(self) -> bool:
        """Async scheduling feeds a step from the previous step's device ids: one device, one host."""
        return self.mesh is None and self.channel is None

    def dispatch(self, chunks: list[ScheduledChunk], source: DispatchedGroup | None = None) -> list[DispatchedGroup]:
        """Start the device steps of `chunks` without waiting for them. With `source` (the previous step, one
        group), `chunks` are look-ahead chunks of its requests: one call, each input token taken on the device
        from the id `source` sampled for the same request."""
        if source is None:
            return [self._dispatch_group(group) for group in self._chunk_groups(chunks)]
        rows = {id(chunk.request): row for row, chunk in enumerate(source.chunks)}
        return [self._dispatch_group(chunks, source.out["token_ids"], [rows[id(c.request)] for c in chunks])]

    def collect(self, dispatched: list[DispatchedGroup]) -> dict[str, StepResult]:
        """Wait for dispatched steps; -> {request_id: result} for every chunk that samples a token or asked for
        prompt logprobs."""
        results: dict[str, StepResult] = {}
        for group in dispatched:
            results.update(self._group_results(group))
        return results

    @staticmethod
    def _chunk_groups(chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """Decodes together; short prefill chunks together; each long chunk alone. A padded group costs
        seqs x max_q x (context + max_q) in attention, so one 1k-token chunk must not pad its neighbours."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        short = [c for c in chunks if 1 < c.num_tokens < LONG_CHUNK_TOKENS]
        long = [[c] for c in chunks if c.num_tokens >= LONG_CHUNK_TOKENS]
        return [group for group in (decodes, short, *long) if group]

    def step_call(self, chunks: list[ScheduledChunk]) -> tuple[StepCall, list]:
        """The host inputs of one group's step, and the requests that asked for prompt logprobs."""
        batch = build_batch(chunk_rows(chunks), self.page_size, self.limits, self.backend.table_pages)
        num_rows = batch.metadata.q_lens.shape[0]
        rows = [self._row_spec(c) for c in chunks]
        sampling, flags = build_sampling_tensors(rows, num_rows)
        asked = [c.request.params.logprobs for c in chunks if c.samples and c.request.params.logprobs is not None]
        num_logprobs = bucket_k(max(asked)) if asked else None
        prompt_targets, prompt_rows = prompt_logprob_targets(chunks, batch.input_ids.shape[0])
        num_prompt_logprobs = bucket_k(max(r.params.prompt_logprobs for r in prompt_rows)) if prompt_rows \
            else None
        self._log_new_shape(("step", *batch.shape_key, flags, num_logprobs, num_prompt_logprobs))
        call = StepCall(batch.input_ids, batch.positions, batch.metadata, sampling, prompt_targets, flags,
                        num_logprobs, num_prompt_logprobs)
        return call, prompt_rows

    def run_call(self, call: StepCall) -> Any:
        """Run one device step (sending it to the other hosts first, on rank 0 of a multi-host mesh);
        -> forward_sample's outputs, or all-position logits [T, V]."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.send(call)
        md, ids, positions, sampling, targets = self._device_inputs(call)
        if call.all_logits:
            logits, _ = self.steps.all_logits(self.weights, self.kv_cache, ids, positions, md)
            return logits
        out, layer_kv = self.steps.forward_sample(
            self.step_weights.for_rows(call.input_ids.shape[0]), self.kv_cache, ids, positions, md, sampling,
            targets, flags=call.flags, num_logprobs=call.num_logprobs, num_prompt_logprobs=call.num_prompt_logprobs)
        self.kv_cache = self.steps.store_kv(self.kv_cache, layer_kv, md)
        return out

    def _device_inputs(self, call: StepCall) -> tuple:
        """-> (metadata, ids, positions, sampling, prompt targets) as the jitted steps take them."""
        inputs = (call.metadata, call.input_ids, call.positions, call.sampling, call.prompt_targets)
        # One batched transfer: ~0.2 ms, against ~1.3 ms for numpy arguments passed to the jit.
        return jax.device_put(inputs) if self.mesh is None else put_replicated(inputs, self.mesh)

    def _dispatch_group(self, chunks: list[ScheduledChunk], source_ids: jax.Array | None = None,
                        source_rows: list[int] | None = None) -> DispatchedGroup:
        """source_ids [S'] int32 on the device, source_rows: the row of each chunk's input token in it."""
        call, prompt_rows = self.step_call(chunks)
        if source_ids is not None:
            rows = np.zeros(call.input_ids.shape[0], np.int32)  # decode chunks: flat token i is chunk i
            rows[:len(source_rows)] = source_rows
            call.input_ids = _take_ids(source_ids, rows)
        return DispatchedGroup(chunks, call, prompt_rows, self.run_call(call))

    def _group_results(self, group: DispatchedGroup) -> dict[str, StepResult]:
        chunks, call, prompt_rows, out = group.chunks, group.call, group.prompt_rows, group.out
        if self.mesh is not None and jax.process_count() > 1:
            out = jax.tree.map(host_array, out)  # replicated over every host's devices: read the local copy
        token_ids = np.asarray(out["token_ids"])
        sample_stats = host_rows(out["sample_stats"], list(range(len(chunks)))) if call.num_logprobs is not None \
            else None
        results: dict[str, StepResult] = {}
        for row, chunk in enumerate(chunks):
            if chunk.samples:
                results[chunk.request.request_id] = StepResult(
                    int(token_ids[row]), sample_stats[row] if sample_stats else None)
        if call.num_prompt_logprobs is not None:
            self._attach_prompt_logprobs(chunks, prompt_rows, out["prompt_stats"], results)
        return results

    @staticmethod
    def _attach_prompt_logprobs(chunks: list[ScheduledChunk], wanted: list, stats: Any,
                                results: dict[str, StepResult]) -> None:
        """Prompt token j's entry comes from the row at position j - 1 of the same sequence."""
        cursor = 0
        for chunk in chunks:
            request = chunk.request
            if request in wanted:
                last = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)  # positions with a target
                entries = host_rows(stats, list(range(cursor, cursor + max(last - chunk.start, 0))))
                result = results.setdefault(request.request_id, StepResult(None, None))
                result.prompt_logprobs, result.prompt_start = entries, chunk.start + 1
            cursor += chunk.num_tokens

    @staticmethod
    def _row_spec(chunk: ScheduledChunk) -> RowSpec:
        """A look-ahead chunk samples the token after the one still on the device."""
        request = chunk.request
        params = request.params
        blocked: list[int] = []
        if len(request.output_token_ids) + chunk.pending_tokens < params.min_tokens:
            blocked = [*params.stop_token_ids, *([] if params.ignore_eos else request.eos_token_ids)]
        return RowSpec(params=params, seed=request.seed, position=request.num_tokens + chunk.pending_tokens,
                       prompt_ids=request.prompt_token_ids, output_ids=request.output_token_ids, blocked_ids=blocked)

    def _log_new_shape(self, key: tuple) -> None:
        if key not in self._seen_shapes:
            self._seen_shapes.add(key)
            logger.info("compiling/using step shape tokens=%d seqs=%d max_q=%d pages=%d %s", *key[1:5], key[5:])

    @property
    def compiled_shapes(self) -> set[tuple]:
        return set(self._seen_shapes)

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits [T, V] at every position of one prompt, through the paged path as one fresh chunk. Nothing is
        written to the pool (pages listed are the reserved page 0, never read: the chunk is its whole context)."""
        n = len(token_ids)
        if self.backend.table_pages(0, n, self.page_size):
            raise NotImplementedError(f"prompt_logits needs a backend that attends to a fresh chunk's own K/V "
                                      f"(xla), not {self.backend.name}")
        row = ChunkRow(token_ids=list(token_ids), start=0, page_table=[0] * cdiv(n, self.page_size))
        limits = BucketLimits(max(n, 1), 1, max(len(row.page_table), 1))
        batch = build_batch([row], self.page_size, limits, self.backend.table_pages)
        logits = self.run_call(StepCall(batch.input_ids, batch.positions, batch.metadata))  # on every host
        return (host_array(logits) if self.mesh is not None else np.asarray(logits))[:n]
