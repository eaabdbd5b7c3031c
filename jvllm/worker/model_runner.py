"""Owns the device side: weights, the donated KV page pool, and the model steps of a closed set of shapes."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention import get_backend
from jvllm.model_loader.loader import LoadedModel
from jvllm.parallel.mesh import host_array, named_sharding, put_replicated
from jvllm.sample.logprobs import host_rows
from jvllm.sample.tensors import build_sampling_tensors, combine_allowed_bits
from jvllm.utils import cdiv
from jvllm.worker.batch import ChunkRow, HostBatch, build_batch
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.compiled_steps import CompiledSteps
from jvllm.worker.encoder_runner import EncoderBufferLayout, encoder_runner
from jvllm.worker.exported_pieces import engine_pieces
from jvllm.worker.huge_pages import back_with_huge_pages
from jvllm.worker.input_transfer import InputTransfer
from jvllm.worker.layer_runs import (LayerRun, layers_per_call, runs_by_kind, runs_kind, short_prefill_tokens,
                                     whole_step_runs)
from jvllm.worker.page_copy import copy_list
from jvllm.worker.step_functions import build_step_functions
from jvllm.worker.step_launcher import StepLauncher, dispatch_thread_asked
from jvllm.worker.step_call import EncoderCall, StepCall
from jvllm.worker.step_plan import ChunkPlan
from jvllm.worker.step_results import DispatchedGroup, PendingHead, StepResult, sampler_token_index
from jvllm.worker.step_shapes import ShapeSet, StepShape
from jvllm.worker.weights import BATCHED_MIN_ROWS, StepWeights

logger = logging.getLogger("jvllm")

PAGE_TABLE_MULTIPLE = 16  # page tables are padded to a multiple of this, so decode loops read whole spans


class ModelRunner:
    """Turns a step's chunk plans into device arrays, runs the compiled step, returns sampled ids to the host."""

    def __init__(self, loaded: LoadedModel, *, num_pages: int, page_size: int, max_model_len: int, shapes: ShapeSet,
                 attention_backend: str, batched_weight_dtype: Any = None, batched_min_rows: int = BATCHED_MIN_ROWS,
                 bf16_block_products: bool = True, invariant_rows: int = 0, int8_block_products: bool = False,
                 channel: Any = None, encoder_buffer: EncoderBufferLayout | None = None,
                 kv_cache_dtype: Any = None):
        """`channel` (multi-host, a jvllm.parallel.distributed.StepChannel): rank 0 sends every step's
        StepCall through it before running it; the other ranks run what they receive. `encoder_buffer` (a
        vision-language model): the size of the encoder buffer, whose rows the engine assigns to images.
        `kv_cache_dtype`: what the KV pages hold (default: the model's dtype)."""
        cfg = loaded.config
        self.loaded = loaded
        self.page_size = page_size
        self.mesh = loaded.mesh
        # XLA:CPU runs each device's share of a collective on a small shared thread pool: two independent
        # sharded executions in flight (a step's layer and the next group's embedding) can fill it with
        # waiting participants and deadlock. Virtual CPU meshes therefore run one executable at a time.
        platform = jax.devices()[0].platform
        self._on_cpu = platform == "cpu"
        self._one_at_a_time = self.mesh is not None and self._on_cpu
        self.channel = channel
        self._inputs = InputTransfer()
        self._head_inputs = InputTransfer()  # a look-ahead step's sampling tensors, sent once its grammars moved
        self.backend = get_backend(attention_backend).for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                                loaded.dtype)
        self.step_weights = StepWeights(loaded.graphdef, loaded.state, batched_dtype=batched_weight_dtype,
                                        sharded=self.mesh is not None, batched_min_rows=batched_min_rows)
        self.shapes = dataclasses.replace(shapes, min_rows=2) if self.step_weights.one_row_dots_slow else shapes
        self.max_pages = cdiv(cdiv(max_model_len, page_size), PAGE_TABLE_MULTIPLE) * PAGE_TABLE_MULTIPLE
        self.history_width = max_model_len
        self.vocab_size = cfg.vocab_size
        self.mrope = cfg.mrope_section is not None  # positions [3, T] (Qwen2-VL)
        self.kv_cache_dtype = jnp.dtype(loaded.dtype if kv_cache_dtype is None else kv_cache_dtype)
        self.kv_cache = self._new_pool(num_pages)
        self.max_page_copies = shapes.max_num_seqs  # a step admits at most this many requests, each copies <= 1 page
        activations = jnp.dtype(loaded.dtype)
        self.encoder = None if loaded.vision is None else encoder_runner(loaded.vision, encoder_buffer, activations,
                                                                         self.mesh)
        steps = build_step_functions(self.step_weights.parts, self.backend, activations, shapes.max_num_seqs,
                                     self.mesh, cfg.vocab_size, multimodal=self.encoder is not None,
                                     bf16_block_products=bf16_block_products, invariant_rows=invariant_rows,
                                     int8_block_products=int8_block_products,
                                     one_row_bf16=self.step_weights.one_row_bf16)
        layer_groups = self.step_weights.parts.layer_groups
        # on a CPU with the native attention, every layer of a step in one call (jvllm.worker.layer_runs)
        whole_steps = whole_step_runs(platform, self.backend.name)
        self._layer_runs = runs_by_kind(layer_groups, layers_per_call(len(layer_groups) if whole_steps else 1))
        self._short_prefill = short_prefill_tokens(whole_steps)
        exported = None
        if self._on_cpu and self.mesh is None:
            # what the pieces' traces read besides their arguments (jvllm.worker.exported_pieces)
            exported = engine_pieces((cfg, self.step_weights.parts, self.backend, activations, self.shapes,
                                      max_model_len, page_size, self.kv_cache_dtype, self._layer_runs,
                                      self._short_prefill, self.encoder is not None, bf16_block_products,
                                      invariant_rows, int8_block_products, self.step_weights.one_row_bf16,
                                      loaded.folder))
        self.compiled = CompiledSteps(steps, self, exported)
        # multi-host leaders send each step before running it, and CPU meshes run one executable at a time: both
        # keep their steps on the engine's thread
        self._launcher = StepLauncher(dispatch_thread_asked() and channel is None and not self._one_at_a_time)
        logger.info("KV pool: %d pages x %d tokens, %.1f MiB", num_pages, page_size,
                    self.kv_pool_bytes(cfg, self.kv_cache_dtype, num_pages, page_size) / 2**20)

    def layer_runs(self, shape: StepShape) -> list[LayerRun]:
        """The runs of layers a step of `shape` calls, one executable each (jvllm.worker.layer_runs)."""
        return self._layer_runs[runs_kind(shape.kind, shape.tokens, self._short_prefill)]

    def back_weights_with_huge_pages(self) -> None:
        """On CPU, put the weights one-token steps read on 2 MiB pages (each decode step streams them: fewer TLB
        misses, jvllm.worker.huge_pages). Called once the engine has freed what no step reads: collapsing a range
        also backs the free memory beside the weights."""
        if self._on_cpu:
            huge = back_with_huge_pages(self.step_weights.for_rows(1).leaves)
            logger.info("%.0f MiB of weights in 2 MiB pages", huge / 2**20)

    @property
    def weights(self) -> list[jax.Array]:
        return self.step_weights.weights.leaves

    @property
    def batched_weights(self) -> list[jax.Array] | None:
        return None if self.step_weights.batched is None else self.step_weights.batched.leaves

    def _new_pool(self, num_pages: int) -> list[tuple[jax.Array, jax.Array]]:
        """Every layer's zeroed K and V pages from one jitted call (faster than one eager zeros per array)."""
        cfg = self.loaded.config
        shape = (num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)  # [N, page, KVH, hd]
        sharding = None if self.mesh is None else named_sharding(  # each device makes only its KV heads
            self.mesh, ("pages", "page_slot", "kv_heads", "head_dim"))
        dtype = self.backend.pool_dtype(self.kv_cache_dtype)
        zeros = jax.jit(lambda: [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)],
                        out_shardings=sharding)
        with compile_watch().expected():
            return zeros()

    @staticmethod
    def kv_pool_bytes(cfg: Any, dtype: Any, num_pages: int, page_size: int) -> int:
        """The whole pool, all devices together (each holds num_kv_heads / tp of the heads)."""
        return 2 * cfg.num_layers * cfg.num_kv_heads * num_pages * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize

    @property
    def can_look_ahead(self) -> bool:
        """Async scheduling feeds a step from the previous step's device ids: one device, one host."""
        return self.mesh is None and self.channel is None

    @property
    def dispatch_keeps_up(self) -> bool:
        """Whether the host dispatches a step's pieces faster than the device runs them, so that a step started
        only once the previous one has ended leaves the device idle for no more than its first piece: on a CPU,
        yes (a layer runs for longer than its dispatch); a GPU runs a small step's layers faster than the host
        dispatches them, so there the next step must be queued while the current one runs."""
        return self._on_cpu

    def step_shapes(self) -> list[StepShape]:
        """The model's step shapes, then the vision encoder's (multimodal models)."""
        return self.shapes.shapes() + ([] if self.encoder is None else self.encoder.step_shapes())

    def precompile(self, progress: Any = None, shapes: list[StepShape] | None = None) -> None:
        """Compile (or load from the persistent cache) every executable of every step shape (or of `shapes`), the
        vision encoder's included."""
        self.compiled.precompile(self.shapes.shapes() if shapes is None else shapes, progress)
        if self.encoder is not None:
            self.encoder.precompile(progress)

    # ---- steps ----------------------------------------------------------------------------------------
    def dispatch(self, plans: list[ChunkPlan], source: DispatchedGroup | None = None,
                 gate: Callable[[], bool] | None = None) -> list[DispatchedGroup] | None:
        """Start the device steps of `plans` without waiting for them: one-token chunks in a decode step, the
        others in a prefill step, or all in one prefill step where the backend attends decode rows inside ragged
        steps and that is cheaper (ShapeSet.mixed_is_cheaper). With `source` (the previous step, one group), `plans`
        are look-ahead chunks of its requests: one decode step, each input token taken on the device from the id
        `source` sampled; if some are grammar-constrained, its sampler waits for finish_head. Such a step, once its
        inputs are ready, starts only if `gate` (when given) says so; otherwise nothing starts and this returns
        None. The images the plans ask to encode are encoded before the first group's step (its StepCall carries
        the encoder steps)."""
        encode = self._encoder_calls(plans)
        copies = self._page_copies(plans)
        if source is not None:
            rows = {plan.request_id: row for row, plan in enumerate(source.plans)}
            group = self._dispatch_group(plans, "decode", source.settle().out["token_ids"],
                                         [rows[plan.request_id] for plan in plans], encode, copies, gate)
            return None if group is None else [group]
        # Prompt logprobs are computed by prefill steps only (a one-token chunk of a prompt may want them).
        decodes = [p for p in plans if p.num_tokens == 1 and p.prompt_targets is None]
        prefills = [p for p in plans if p.num_tokens != 1 or p.prompt_targets is not None]
        if decodes and prefills and self.backend.mixes_decode_rows and self.shapes.mixed_is_cheaper(
                len(decodes), sum(p.num_tokens for p in prefills)):
            # one ragged step: weights read once
            return [self._dispatch_group(decodes + prefills, "prefill", encode=encode, copies=copies)]
        groups = [(group, kind) for group, kind in ((decodes, "decode"), (prefills, "prefill")) if group]
        return [self._dispatch_group(group, kind, encode=encode if index == 0 else (),
                                     copies=copies if index == 0 else None)
                for index, (group, kind) in enumerate(groups)]

    def _page_copies(self, plans: list[ChunkPlan]) -> np.ndarray | None:
        """The pages to copy before the step (chunks starting from a cached tail) as [2, max_page_copies] int32."""
        copies = [plan.page_copy for plan in plans if plan.page_copy is not None]
        return copy_list(copies, self.max_page_copies) if copies else None

    def page_copy_inputs(self, pairs: np.ndarray) -> tuple:
        """[2, C] int32 (source, target) pages -> the page copier's sources and targets on the device."""
        inputs = (pairs[0], pairs[1])
        return jax.device_put(inputs) if self.mesh is None else put_replicated(inputs, self.mesh)

    def _encoder_calls(self, plans: list[ChunkPlan]) -> tuple[EncoderCall, ...]:
        """The encoder steps of the images this step's chunks need first (the step reads their rows)."""
        items = {item.key: item for plan in plans for item in plan.encode}
        if not items:
            return ()
        if self.encoder is None:
            raise ValueError("this model takes no images")
        return tuple(self.encoder.calls(list(items.values())))

    def collect(self, dispatched: list[DispatchedGroup]) -> dict[str, StepResult]:
        """Wait for dispatched steps; -> {request_id: result} for every chunk that samples a token or asked for
        prompt logprobs."""
        results: dict[str, StepResult] = {}
        for group in dispatched:
            results.update(self._group_results(group))
        return results

    def shape_for(self, plans: list[ChunkPlan], kind: str) -> StepShape:
        if kind == "decode":
            return self.shapes.decode(len(plans))
        return self.shapes.prefill(sum(p.num_tokens for p in plans))

    def step_call(self, plans: list[ChunkPlan], kind: str, encode: tuple[EncoderCall, ...] = (),
                  copies: np.ndarray | None = None) -> StepCall:
        """The host inputs of one group's step, after the encoder steps `encode` and the page `copies`."""
        shape = self.shape_for(plans, kind)
        batch = self.host_batch([plan.row for plan in plans], shape)
        targets = np.full(shape.tokens, -1, np.int32)  # [T] next prompt token of each position, -1 elsewhere
        cursor = 0
        for plan in plans:
            if plan.prompt_targets is not None:
                targets[cursor:cursor + plan.num_tokens] = plan.prompt_targets
            cursor += plan.num_tokens
        specs = [spec for plan in plans for spec in (plan.spec, *(plan.verify_specs if plan.samples else ()))]
        if len(specs) > shape.seqs:
            raise ValueError(f"{len(specs)} sampler rows do not fit a {shape} step")
        sampling, flags = build_sampling_tensors(specs, shape.seqs, vocab_size=self.vocab_size,
                                                 history_width=self.history_width)
        sampling.token_index[:len(specs)] = sampler_token_index(plans)
        wants_targets = any(plan.prompt_targets is not None for plan in plans)
        return StepCall(shape, batch.input_ids, batch.positions, batch.metadata, sampling,
                        targets if wants_targets else None, flags, batch.mm_rows, encode, copies)

    def host_batch(self, rows: list[ChunkRow], shape: StepShape) -> HostBatch:
        return build_batch(rows, shape, self.page_size, self.max_pages, self.backend.prefill_layout,
                           multimodal=self.encoder is not None, mrope=self.mrope)

    def run_call(self, call: StepCall, defer_head: bool = False) -> Any:
        """Run one device step after its encoder steps (sending it to the other hosts first, on rank 0 of a
        multi-host mesh); -> the head's outputs, or all-position logits [T, V]; with `defer_head`, a PendingHead:
        the layers and the KV write are dispatched, the sampler runs when called with the (possibly updated)
        sampling tensors."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.send(call)
        settle = jax.block_until_ready if self._one_at_a_time else (lambda value: value)
        if call.page_copies is not None:
            self.kv_cache = settle(self.compiled.page_copier()(self.kv_cache, *self.page_copy_inputs(call.page_copies)))
        for encoder_call in call.encode:
            self.encoder.run(encoder_call)
            settle(self.encoder.buffer)
        # what the layers read goes first; the sampler's inputs are sent while the layers run
        md, ids, positions, mm_rows = self.layer_inputs(call)
        step = self.compiled.get(call.shape)
        weights = self.step_weights.for_rows(call.shape.tokens)
        features = () if self.encoder is None else (mm_rows, self.encoder.buffer)
        with compile_watch().running(call.shape):
            x, cos, sin = settle(step.embed(weights.outer, ids, positions, *features))
            results = []
            for run in self.layer_runs(call.shape):
                x, run_results = settle(step.layers[run.groups](weights.layers[run.start:run.stop], x, cos, sin,
                                                                self.kv_cache[run.start:run.stop], md))
                if self.backend.step_donates_pool:
                    self.kv_cache[run.start:run.stop] = run_results  # the pages went in donated: the results hold them
                results.extend(run_results)
            if call.all_logits:
                return settle(step.logits(weights.outer, x))
            sampling, targets = self.sampler_inputs(call)
            x_last = settle(step.last_rows(x, sampling.token_index))
            extra = {} if targets is None else {"prompt_stats": settle(step.prompt_stats(weights.outer, x, targets))}
            self.kv_cache = settle(step.store_kv(self.kv_cache, results, md))
            logits = settle(step.head.logits(weights.outer, x_last, sampling.num_rows))  # [S, V] float32

        def head(device_sampling: Any) -> dict:
            with compile_watch().running(call.shape):
                return {**settle(step.head.sample(call.flags, logits, device_sampling)), **extra}

        return PendingHead(head) if defer_head else head(sampling)

    def finish_head(self, group: DispatchedGroup, grammar_bits: list[np.ndarray | None]) -> None:
        """Sample a deferred look-ahead step: `grammar_bits` [W] int32 per row (None: unconstrained or finished),
        each constrained row's grammar advanced past the token the previous step sampled, narrow its tokens now."""
        sampling = group.settle().call.sampling
        for row, bits in enumerate(grammar_bits):
            if bits is not None:
                sampling.allowed_bits[row] = combine_allowed_bits(sampling.allowed_bits[row], bits)
        group.out, group.pending = group.pending.run(self._to_devices(self._head_inputs, sampling)), None

    def device_inputs(self, call: StepCall) -> tuple:
        """-> (metadata, ids, positions, sampling, prompt targets, mm rows) on the device, as the steps take them."""
        md, ids, positions, mm_rows = self.layer_inputs(call)
        return (md, ids, positions, *self.sampler_inputs(call), mm_rows)

    def layer_inputs(self, call: StepCall) -> tuple:
        """-> (metadata, ids, positions, mm rows) on the device: what the embedding and the layers read. A step
        whose host work is not hidden behind the previous one's (after a verification step, say) starts its
        layers before the sampler's inputs are sent (`sampler_inputs`): ~0.2 ms sooner on the 2-core CPU."""
        return self._to_devices(self._inputs, (call.metadata, call.input_ids, call.positions, call.mm_rows))

    def sampler_inputs(self, call: StepCall) -> tuple:
        """-> (sampling tensors, prompt targets) on the device: what the head and the sampler read."""
        return self._to_devices(self._inputs, (call.sampling, call.prompt_targets))

    def _to_devices(self, transfer: InputTransfer, tree: Any) -> Any:
        """Host arrays -> the device through `transfer` (unchanged arrays reused), or replicated over the mesh."""
        return transfer.put(tree) if self.mesh is None else put_replicated(tree, self.mesh)

    def _dispatch_group(self, plans: list[ChunkPlan], kind: str, source_ids: jax.Array | None = None,
                        source_rows: list[int] | None = None, encode: tuple[EncoderCall, ...] = (),
                        copies: np.ndarray | None = None,
                        gate: Callable[[], bool] | None = None) -> DispatchedGroup | None:
        """source_ids [S'] int32 on the device, source_rows: the row of each chunk's input token in it; `encode`
        and `copies`: the encoder steps and page copies to run first; `gate`: see `dispatch`."""
        call = self.step_call(plans, kind, encode, copies)
        defer_head = False
        if source_ids is not None:
            rows = np.zeros(call.shape.seqs, np.int32)  # decode: token i is chunk i
            rows[:len(source_rows)] = source_rows
            call.input_ids = self.compiled.get(call.shape).take_ids(source_ids, rows)
            defer_head = any(plan.constrained for plan in plans)
        if gate is not None and not gate():
            return None
        group = DispatchedGroup(plans, call, None, head_waits=defer_head,
                                launch=self._launcher.launch(lambda: self.run_call(call, defer_head)))
        return group if self._launcher.threaded else group.settle()

    @staticmethod
    def wait_for(group: DispatchedGroup) -> None:
        """Block until the device has sampled `group`'s ids (returns at once for a deferred head, not yet run)."""
        if group.settle().out is not None:
            jax.block_until_ready(group.out["token_ids"])

    def _group_results(self, group: DispatchedGroup) -> dict[str, StepResult]:
        plans, out = group.plans, group.settle().out
        if self.mesh is not None and jax.process_count() > 1:
            out = jax.tree.map(host_array, out)  # replicated over every host's devices: read the local copy
        token_ids: list[int] = np.asarray(out["token_ids"]).tolist()
        num_rows = sum(plan.sampler_rows for plan in plans)
        asked = any(p.samples and p.wants_logprobs for p in plans)
        sample_stats = host_rows(out["sample_stats"], list(range(num_rows))) if asked else None

        def sampled(row: int, plan: ChunkPlan) -> StepResult:
            return StepResult(token_ids[row], sample_stats[row] if plan.wants_logprobs and sample_stats else None)

        results: dict[str, StepResult] = {}
        row = 0
        for plan in plans:
            if plan.samples:
                result = results[plan.request_id] = sampled(row, plan)
                if plan.draft_ids:
                    result.after_drafts = [sampled(row + 1 + i, plan) for i in range(len(plan.draft_ids))]
            row += plan.sampler_rows
        cursor = 0
        for plan in plans:  # prompt token j's entry comes from the row at position j - 1 of the same sequence
            if plan.prompt_targets is not None:
                entries = host_rows(out["prompt_stats"], list(range(cursor, cursor + plan.num_prompt_targets)))
                result = results.setdefault(plan.request_id, StepResult(None, None))
                result.prompt_logprobs, result.prompt_start = entries, plan.row.start + 1
            cursor += plan.num_tokens
        return results
