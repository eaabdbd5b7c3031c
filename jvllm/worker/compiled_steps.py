"""Ahead-of-time compiled executables of every step shape: compiled once from example inputs of the shape (XLA's
work comes from JAX's persistent cache after the first start), then called directly, so a step never traces or
compiles."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np

from jvllm.sample.tensors import (SamplerFlags, build_sampling_tensors, empty_masks, mask_inputs, penalty_inputs,
                                  scalars_only)
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.executable_memo import compile_once
from jvllm.worker.exported_pieces import ExportedPieces
from jvllm.worker.layer_runs import LayerRun, first_runs
from jvllm.worker.step_call import StepCall
from jvllm.worker.step_functions import StepFunctions
from jvllm.worker.step_shapes import StepShape


class StepInputs(Protocol):
    """What CompiledSteps reads of its runner (jvllm.worker.model_runner.ModelRunner): the weights, the pool and
    the way host inputs become device inputs."""

    step_weights: Any
    encoder: Any
    kv_cache: list
    max_page_copies: int
    vocab_size: int
    history_width: int

    def host_batch(self, rows: list, shape: StepShape) -> Any: ...

    def layer_runs(self, shape: StepShape) -> list[LayerRun]: ...

    def device_inputs(self, call: StepCall) -> tuple: ...

    def page_copy_inputs(self, pairs: np.ndarray) -> tuple: ...

logger = logging.getLogger("jvllm")

Executable = Callable[..., Any]
PROCESSORS = ("penalties", "masks")  # in the order a step runs them


@dataclasses.dataclass
class CompiledHead:
    """The head of one row count in three parts: logits, the processors a step's flags ask for (token
    penalties, token masks), then the sampler's pick. Split so that the sampler, the costliest piece to compile,
    is one executable per row count whatever the flags."""

    logits: Executable  # (outer, x_last [S, D], num_rows []) -> [S, V] float32
    pick: Executable  # (logits, processed [S, V], per-row scalars) -> {token_ids, sample_stats}
    processor: Callable[[str], Executable]  # a name in PROCESSORS -> its executable (compiled on first use)

    def sample(self, flags: SamplerFlags, logits: jax.Array, sampling: Any) -> dict:
        """logits [S, V] from `self.logits`, sampling tensors on the device -> the pick's outputs."""
        processed = logits
        if flags.penalties:
            processed = self.processor("penalties")(processed, penalty_inputs(sampling))
        if flags.masks:
            processed = self.processor("masks")(processed, mask_inputs(sampling))
        return self.pick(logits, processed, scalars_only(sampling))

    def as_text(self, flags: SamplerFlags) -> str:
        """Optimized HLO of every executable a step with `flags` runs."""
        names = [name for name in PROCESSORS if getattr(flags, name)]
        return "\n".join(e.as_text() for e in (self.logits, *(self.processor(n) for n in names), self.pick))


@dataclasses.dataclass
class ShapeExecutables:
    """One step shape's executables. A layer-run executable serves every run of the same layer groups; the head is
    shared by the shapes with the same number of rows."""

    shape: StepShape
    embed: Executable
    layers: dict[tuple[int, ...], Executable]  # by the groups of a run's layers (jvllm.worker.layer_runs)
    last_rows: Executable
    store_kv: Executable
    head: CompiledHead
    take_ids: Executable | None  # decode shapes: input ids gathered from a previous step's
    prompt_stats: Executable | None  # prefill shapes
    _logits: Callable[[], Executable]  # all-position logits (a diagnostic), compiled when first asked for

    @property
    def layer(self) -> Executable:
        """The executable of the run holding the first layer."""
        return next(iter(self.layers.values()))

    @property
    def logits(self) -> Executable:
        return self._logits()


class CompiledSteps:
    """Per step shape, the compiled pieces of `steps` for the runner's weights, pool and input layout."""

    def __init__(self, steps: StepFunctions, runner: StepInputs, exported: ExportedPieces | None = None) -> None:
        """`exported`: where the pieces' traced modules are kept between starts (None: every piece is traced)."""
        self.steps = steps
        self.runner = runner
        self.exported = exported
        self.count = 0  # executables compiled so far
        self._by_shape: dict[StepShape, ShapeExecutables] = {}
        self._head_logits: dict[tuple[int, bool], Executable] = {}  # by (rows, batched weights)
        self._picks: dict[int, Executable] = {}  # by rows
        self._processors: dict[tuple[int, str], Executable] = {}  # by (rows, name)
        self._page_copier: Executable | None = None

    def get(self, shape: StepShape) -> ShapeExecutables:
        """The shape's executables (compiled now if precompiling was skipped)."""
        executables = self._by_shape.get(shape)
        if executables is None:
            logger.info("compiling step shape %s", shape)
            with compile_watch().expected():  # precompiling was skipped: compiling on first use is asked for
                executables = self._by_shape[shape] = self._compile(shape, every_head=False)
        return executables

    def precompile(self, shapes: list[StepShape], progress: Any = None) -> None:
        """Compile (or load) every shape not compiled yet; `progress` (a tqdm bar) advances once per shape."""
        started = time.perf_counter()
        before = self.count
        with compile_watch().expected():
            for shape in shapes:
                if shape not in self._by_shape:
                    self._by_shape[shape] = self._compile(shape)
                if progress is not None:
                    progress.update(1)
            self.page_copier()
        loaded = "" if self.exported is None else (f", {self.exported.loaded} of them from stored modules, "
                                                    f"{self.exported.reused} from an earlier engine of this process")
        logger.info("%d step shapes ready in %.1fs (%d executables%s)", len(shapes), time.perf_counter() - started,
                    self.count - before, loaded)

    def page_copier(self) -> Executable:
        """(pool, sources [C], targets [C]) -> the pool with those pages copied (compiled here on first use if
        precompiling was skipped)."""
        if self._page_copier is None:
            inputs = self.runner.page_copy_inputs(np.zeros((2, self.runner.max_page_copies), np.int32))
            with compile_watch().expected():
                self._page_copier = self._compiled("copy pages", self.steps.copy_pages, self.runner.kv_cache, *inputs)
        return self._page_copier

    def _examples(self, shape: StepShape, flags: SamplerFlags = SamplerFlags()) -> tuple:
        """Device inputs of an empty step of `shape`, laid out exactly as run_call passes them."""
        runner = self.runner
        batch = runner.host_batch([], shape)
        sampling, _ = build_sampling_tensors([], shape.seqs, vocab_size=runner.vocab_size,
                                             history_width=runner.history_width)
        if flags.penalties:
            sampling.history = np.full((shape.seqs, runner.history_width), -1, np.int32)
            sampling.num_prompt = np.zeros(shape.seqs, np.int32)
        if flags.masks:
            sampling.allowed_bits, sampling.bias_ids, sampling.bias_values = empty_masks(shape.seqs, runner.vocab_size)
        call = StepCall(shape, batch.input_ids, batch.positions, batch.metadata, sampling,
                        np.full(shape.tokens, -1, np.int32), flags, batch.mm_rows)
        return runner.device_inputs(call)

    def _compile(self, shape: StepShape, every_head: bool = True) -> ShapeExecutables:
        """The shape's pieces; without `every_head`, the head's processors are compiled when a step first needs
        them (engines that skip precompiling: tests, quick experiments)."""
        steps, runner, compiled = self.steps, self.runner, self._compiled
        weights = runner.step_weights.for_rows(shape.tokens)
        md, ids, positions, sampling, targets, mm_rows = self._examples(shape)
        encoder = runner.encoder
        features = () if encoder is None else (mm_rows, encoder.buffer)
        embed = compiled(f"embed {shape}", steps.embed, weights.outer, ids, positions, *features)
        x, cos, sin = (_spec(a) for a in embed.out_info)
        layers = {groups: compiled(f"layers {shape} groups {groups}", steps.layer_runs(len(groups)),
                                   weights.layers[run.start:run.stop], x, cos, sin,
                                   runner.kv_cache[run.start:run.stop], md, groups=groups)
                  for groups, run in first_runs(runner.layer_runs(shape)).items()}
        results = [jax.tree.map(_spec, result) for run in runner.layer_runs(shape)
                   for result in layers[run.groups].out_info[1]]
        store = steps.store_kv
        if hasattr(store, "lower"):
            store = compiled(f"store {shape}", store, runner.kv_cache, results, md)
        last_rows = compiled(f"last rows {shape}", steps.last_rows, x, sampling.token_index)
        x_last = _spec(last_rows.out_info)
        head = self._head(shape, weights.outer, x_last, every_head)
        take_ids = prompt_stats = None
        if shape.kind == "decode":
            source = _spec(head.pick.out_info["token_ids"])
            take_ids = compiled(f"take ids {shape}", steps.take_ids, source, ids)
        else:
            prompt_stats = compiled(f"prompt stats {shape}", steps.prompt_stats, weights.outer, x, targets)
        logits_cache: list[Executable] = []

        def logits() -> Executable:
            if not logits_cache:
                logits_cache.append(compiled(f"logits {shape}", steps.logits, weights.outer, x))
            return logits_cache[0]

        return ShapeExecutables(shape, embed, layers, last_rows, store, head, take_ids, prompt_stats, logits)

    def _compiled(self, name: str, fn: Any, *args: Any, **static: Any) -> Executable:
        """fn (a jax.jit function) compiled for args; `name` says which piece, for profiles and errors.

        Compiling stays on this thread: a persistent-cache load beside lowering on another thread is not safe
        (docs/design/step_shapes.md). An executable another engine of this process compiled from the same module
        is reused. With `exported`, the piece is lowered as a call of its stored module where it has one, or taken
        from an earlier engine of this process that compiled the same stored module without lowering again."""
        self.count += 1
        compiled = None if self.exported is None else self.exported.compile(name, fn, args, static)
        return compile_once(fn.lower(*args, **static)) if compiled is None else compiled

    def _head(self, shape: StepShape, outer: list[jax.Array], x_last: Any, every_processor: bool) -> CompiledHead:
        """The head for this shape's row count. Its logits also depend on the weights (a batched copy serves
        multi-row steps); the processors and the pick only on the row count."""
        rows = shape.seqs
        sampling = self._examples(shape, SamplerFlags(penalties=True, masks=True))[3]
        key = (rows, shape.tokens >= self.runner.step_weights.batched_min_rows)
        if key not in self._head_logits:
            self._head_logits[key] = self._compiled(f"head logits S={rows}", self.steps.head_logits, outer, x_last,
                                                    sampling.num_rows)
        head_logits = self._head_logits[key]
        logits = _spec(head_logits.out_info)
        if rows not in self._picks:
            self._picks[rows] = self._compiled(f"pick S={rows}", self.steps.pick, logits, logits,
                                               scalars_only(sampling))

        def processor(name: str) -> Executable:
            if (rows, name) not in self._processors:
                fn, inputs = ((self.steps.penalize, penalty_inputs) if name == "penalties"
                              else (self.steps.mask_tokens, mask_inputs))
                with compile_watch().expected():
                    self._processors[rows, name] = self._compiled(f"{name} S={rows}", fn, logits, inputs(sampling))
            return self._processors[rows, name]

        if every_processor:
            for name in PROCESSORS:
                processor(name)
        return CompiledHead(head_logits, self._picks[rows], processor)


def _spec(a: Any) -> jax.ShapeDtypeStruct:
    """An abstract value with the array's sharding, from a compiled executable's out_info."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
