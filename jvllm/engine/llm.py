"""Engine (alias LLM): vLLM's offline API over the scheduler, the model runner and the output processor."""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import random
import time
from typing import Any, Callable, Iterable

from jvllm.collector import collector_paused
from jvllm.heap import release_freed_memory, reuse_freed_memory
from jvllm.logging_setup import configure_default_logging
from jvllm.worker.compile_cache import enable_compilation_cache
from jvllm.worker.compile_watch import during_start_up
from jvllm.config import EngineConfig, UsageContext
from jvllm.engine.arg_utils import EngineArgs, keyword_help
from jvllm.engine.start_up import (attention_backend_for, drop_unread_weights, engine_config_for, eos_token_ids,
                                   log_ready, model_sampling_defaults)
from jvllm.engine.detokenizer import IncrementalDetokenizer
from jvllm.engine.batch_calls import BatchCalls
from jvllm.engine.pooling_calls import PoolingCalls
from jvllm.engine.beam_calls import BeamSearchCalls
from jvllm.pooling.embedder import generate_unsupported
from jvllm.core.bad_words import bad_word_ids
from jvllm.core.kv_pages import PageManager
from jvllm.core.lookahead import lookahead_possible, reserve_lookahead, settle_lookahead
from jvllm.worker.model_runner import ModelRunner
from jvllm.engine.step_plan import StepInFlight, encoder_buffer_layout
from jvllm.worker.weights import (batch_invariant_for, batched_weights_for, bf16_block_products,
                                  int8_block_products, invariant_step_rows_for, matrix_dtype_at_load)
from jvllm.worker.step_shapes import ShapeSet
from jvllm.sample.logprobs import MAX_LOGPROBS
from jvllm.parallel import distributed
from jvllm.engine.output_processor import append_sampled, record_prompt_logprobs, request_output
from jvllm.outputs import RequestOutput
from jvllm.engine.progress import precompile_progress
from jvllm.engine.front_end_views import FrontEndViews
from jvllm.engine.multihost import MultiHostRoles
from jvllm.engine.prompts import PromptType, tokenize_prompt
from jvllm.multimodal.inputs import PromptImages, engine_multimodal
from jvllm.core.request import Request, RequestStatus
from jvllm.sampling_params import SamplingParams, StructuredOutputsParams
from jvllm.core.scheduler import ScheduledChunk, Scheduler, check_priority
from jvllm.structured.grammar import GrammarCompiler
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.drafter import Drafter
from jvllm.engine.draft_model import DraftModelRunner

logger = logging.getLogger("jvllm")
ENGINE_KEYWORDS = frozenset(field.name for field in dataclasses.fields(EngineArgs)) - {"model"}
PROMPT_TAIL_TOKENS = 16  # enough to see whether a chat template opened a <think> block at the end of a prompt


class Engine(MultiHostRoles, FrontEndViews, BatchCalls, PoolingCalls, BeamSearchCalls):
    """Offline inference engine. `Engine()` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        """`model` and the keywords are the fields of `EngineArgs` (jvllm.engine.arg_utils), listed below; each is
        also a flag of `jvllm generate/serve/chat`. Unknown keywords raise TypeError.

        With `num_hosts` > 1 (or $JVLLM_NUM_HOSTS), every host builds the same Engine with its `host_rank` and rank
        0's `coordinator` HOST:PORT: the mesh spans every host's devices, rank 0 schedules and generates, the
        others call `follow()` until rank 0's `shutdown()` (also run at exit).

        The engine runs a closed set of step shapes (`step_shapes()`), known from its config; `precompile` compiles
        all of them (or loads them from the persistent cache) before the engine takes requests.

        Keywords:
"""
        unknown = sorted(set(kwargs) - ENGINE_KEYWORDS)
        if unknown:
            raise TypeError(f"Engine() got unexpected keyword argument(s) {', '.join(unknown)}; it takes the fields "
                            "of jvllm.EngineArgs")
        self._start(EngineArgs(model=model, **kwargs), UsageContext.LLM_CLASS)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage_context: UsageContext = UsageContext.LLM_CLASS) -> "Engine":
        """The engine of an `EngineArgs` (e.g. one built from command-line flags); `jvllm serve` passes
        UsageContext.OPENAI_API_SERVER, whose defaults suit a server (fewer sequences a step on CPU, as vLLM's)."""
        engine = cls.__new__(cls)
        engine._start(args, usage_context)
        return engine

    @during_start_up
    @collector_paused()
    def _start(self, args: EngineArgs, usage: UsageContext) -> None:
        """Load the model, size the KV pool, build the scheduler and the runner, and precompile."""
        self.args = args
        configure_default_logging()  # a plain Python program sees the start-up phases, as vLLM's users do
        from jvllm.pooling.embedder import build_embedder
        from jvllm.model_loader.loader import load_model
        from jvllm.worker.kv_cache_dtype import kv_cache_dtype_for

        hosts = distributed.HostSettings.resolve(args.num_hosts, args.host_rank, args.coordinator)
        distributed.initialize(hosts)  # before any other JAX call
        if hosts.multi_host and args.tensor_parallel_size == 1:
            raise ValueError(f"num_hosts={hosts.num_hosts} needs tensor_parallel_size equal to the number of "
                             "devices of all hosts together")
        enable_compilation_cache()
        started = time.perf_counter()
        self.model = load_model(args.model, dtype=args.dtype, load_format=args.load_format, tokenizer=args.tokenizer,
                                served_model_name=(args.served_model_names or [None])[0], seed=args.seed,
                                tensor_parallel_size=args.tensor_parallel_size,
                                mm_processor_kwargs=args.mm_processor_kwargs, quantization=args.quantization,
                                matrix_dtype=matrix_dtype_at_load(args.dtype, args.batched_weight_dtype,
                                                                  pooling=args.pooling,
                                                                  tensor_parallel_size=args.tensor_parallel_size))
        release_freed_memory()  # the loader's staging reads, before the weight copy adds to the heap
        self.tokenizer = self.model.tokenizer
        self.default_sampling = model_sampling_defaults(args, self.model.folder)
        backend = attention_backend_for(args.attention_backend, self.model)
        kv_dtype = kv_cache_dtype_for(args.kv_cache_dtype, args.dtype, self.model, backend)
        self.config: EngineConfig = engine_config_for(self.model, args, kv_dtype, usage, hosts.multi_host)
        self.enable_prefix_caching = args.enable_prefix_caching
        cfg = self.config
        self.pages = PageManager(cfg.num_pages, cfg.page_size)
        self.encoder_cache, self.mm_processor, self.media = engine_multimodal(
            self.model, cfg.max_num_batched_tokens, args.limit_mm_per_prompt, args.allowed_local_media_path,
            args.encoder_cache_tokens, allowed_media_domains=args.allowed_media_domains, max_image_pixels=args.max_image_pixels)
        image_tokens = 0 if self.model.vision is None else self.model.vision.max_image_tokens
        speculative = SpeculativeConfig.parse(args.speculative_config)
        self.batch_invariant = batch_invariant_for(args.batch_invariant, self.model, backend)
        self.draft_model = None
        if speculative is not None and speculative.method == "draft_model" and not self.model.is_encoder:
            self.draft_model = DraftModelRunner.start(args, cfg, self.tokenizer, speculative, hosts.multi_host)
        # with batch_invariant, steps of up to this many token rows give each row its own bits (0: no such promise)
        self.invariant_step_rows = invariant_step_rows_for(self.model) if self.batch_invariant else 0
        self.drafter = None if speculative is None or self.model.is_encoder else Drafter(
            speculative, self.draft_model, max_step_rows=self.invariant_step_rows or None)
        self.scheduler = Scheduler(self.pages, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   enable_prefix_caching=args.enable_prefix_caching, encoder_cache=self.encoder_cache,
                                   max_num_encoder_tokens=max(cfg.max_num_batched_tokens, image_tokens),
                                   policy=args.scheduling_policy, drafter=self.drafter)
        shapes = ShapeSet(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        batched_dtype = batched_weights_for(args.batched_weight_dtype, args.dtype, self.model)
        self.channel = distributed.StepChannel() if hosts.multi_host else None
        if self.channel is not None:
            self.channel.warm_up()  # every host, here: the broadcasts compile at start, not during steps
        self.runner = None if self.model.is_encoder else ModelRunner(
            self.model, num_pages=cfg.num_pages, page_size=cfg.page_size, max_model_len=cfg.max_model_len,
            shapes=shapes, attention_backend=backend, batched_weight_dtype=batched_dtype, channel=self.channel,
            bf16_block_products=bf16_block_products(args.batched_weight_dtype),
            int8_block_products=int8_block_products(args.batched_weight_dtype),
            invariant_rows=self.invariant_step_rows,
            encoder_buffer=encoder_buffer_layout(self.encoder_cache), kv_cache_dtype=kv_dtype)
        if self.channel is not None and self.channel.is_leader:
            atexit.register(self.shutdown)  # followers must not wait forever for the next step
        self.embedder = build_embedder(self.model, cfg, pooling=args.pooling, normalize=args.normalize,
                                       batched_weight_dtype=batched_dtype if self.model.is_encoder
                                       or args.batched_weight_dtype != "auto" else None)
        drop_unread_weights(self.model, self.runner, self.embedder)
        release_freed_memory()  # the dropped weights and the copy's staging, before ...
        if self.runner is not None:
            self.runner.back_weights_with_huge_pages()  # ... collapsing backs free memory beside the weights too
        self.async_scheduling = bool(args.async_scheduling and self.runner is not None and self.runner.can_look_ahead)
        self._ahead: StepInFlight | None = None  # the look-ahead step in flight, if any
        # Set by a front end whose callers add requests between steps (AsyncEngine): whether one is queued now.
        self.arrivals: Callable[[], bool] | None = None
        self._rng = random.Random(args.seed)
        self._counter = itertools.count()
        self._request_groups: dict[str, list[Request]] = {}
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self._token_text: dict[int, str] = {}
        self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids,
                                         args.reasoning_parser)
        if args.precompile:
            self.precompile()
        release_freed_memory()  # what loading and compiling freed (1 GB of an 8B GGUF's) would stay resident
        reuse_freed_memory()  # ... while what steps free is kept for the next step (jvllm.heap)
        log_ready(self, backend, time.perf_counter() - started)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take: as loaded and kept (GGUF blocks as stored), and the batched low-precision copy."""
        arrays = self.model.arrays + (self.runner.step_weights.arrays if self.runner is not None else [])
        return sum(int(a.nbytes) for a in {id(a): a for a in arrays}.values())

    # ---- step shapes ----------------------------------------------------------------------------
    def step_shapes(self) -> list[Any]:
        """Every step shape this engine can run (generation steps, then embedding batches if it embeds)."""
        shapes: list[Any] = self.runner.step_shapes() if self.runner is not None else []
        return shapes + (self.embedder.batch_shapes() if self.embedder is not None else [])

    def precompile(self, *, max_step_tokens: int | None = None, max_rows: int | None = None) -> None:
        """Compile every step shape (or load it from the persistent cache), with a progress bar. A run whose requests
        are all known before it starts (`jvllm generate`) may bound its steps instead: only the shapes of at most
        `max_step_tokens` tokens and `max_rows` sequences (ShapeSet.reachable) are compiled."""
        shapes, generation = self.step_shapes(), None
        if self.runner is not None and (max_step_tokens is not None or max_rows is not None):
            generation = self.runner.shapes.reachable(max_step_tokens or self.config.max_num_batched_tokens,
                                                      max_rows or self.config.max_num_seqs)
            left_out = set(self.runner.shapes.shapes()) - set(generation)
            shapes = [shape for shape in shapes if shape not in left_out]
        started = time.perf_counter()
        with precompile_progress(len(shapes)) as progress:
            if self.runner is not None:
                self.runner.precompile(progress, generation)
            if self.embedder is not None:
                self.embedder.precompile(progress)
        logger.info("precompiled %d step shapes in %.1fs", len(shapes), time.perf_counter() - started)
        if self.draft_model is not None:
            self.draft_model.precompile(max_step_tokens=max_step_tokens, max_rows=max_rows)

    def _decode_token(self, token_id: int) -> str:
        """One token's text, as logprob entries show it (cached: the same ids recur constantly)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- step-level API -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue one prompt; raises ValueError (and queues nothing) if it can never be served. `priority` (lower
        runs first) needs scheduling_policy='priority'."""
        params = params or SamplingParams()
        self._check_leader()
        check_priority(priority, self.scheduler.policy)
        if self.model.is_encoder:
            raise generate_unsupported(self.model.served_name, self.model.is_cross_encoder)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._request_groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        images = PromptImages(self.mm_processor, prompt, self.model.served_name)
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, self.model.config.vocab_size,
                                          self.config.max_model_len, images.expand, params.truncate_prompt_tokens)
        params.validate_for_vocab(self.model.config.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > MAX_LOGPROBS:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the maximum of {MAX_LOGPROBS}")
        grammar = None
        if params.structured_outputs is not None:
            tail = self.tokenizer.decode(token_ids[-PROMPT_TAIL_TOKENS:])
            grammar = self._grammars.new_state(params.structured_outputs, tail)
        bad_words = bad_word_ids(self.tokenizer, params.bad_words)
        members = []
        for index in range(params.n):
            member_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = self._rng.getrandbits(32) if params.seed is None else (params.seed + index * 0x9E3779B1) % 2**32
            request = Request(member_id, text, token_ids, params, seed, self.config.max_model_len,
                              self.eos_token_ids, arrival_time, priority)
            request.group_id = request_id
            request.bad_word_ids = bad_words
            request.cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            request.detokenizer = (IncrementalDetokenizer(self.tokenizer, token_ids, params)
                                   if params.detokenize else None)
            request.grammar = grammar if grammar is None or index == 0 else grammar.copy()
            request.mm_items = images.items
            self.scheduler.check_fits(request)
            request.prompt_source = members[0] if members else None
            members.append(request)
        for request in members:
            self.scheduler.add(request)
        self._request_groups[request_id] = members

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint's grammar; ValueError naming the field when it is over a limit or does not compile.
        The compiled grammar is kept, so add_request does not compile it again; this lets a server refuse the
        request, and do the compiling, before queueing it."""
        self._grammars.compiled(params)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their pages; unknown ids are ignored, as in vLLM."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for request in self._request_groups.pop(rid, []):
                if not request.is_finished:
                    self._finish(request, RequestStatus.FINISHED_ABORTED)
        if self._ahead is not None and all(c.request.is_finished for c in self._ahead.chunks):
            self._ahead = None  # nobody is left to read the look-ahead step's results

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (pages in use stay valid for their requests). -> True, as vLLM's does."""
        self.scheduler.reset_prefix_cache()
        return True

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, process results; -> outputs of every prompt that advanced.

        With async scheduling, the next decode step is dispatched before this one's ids are read (see
        jvllm.core.lookahead), and the following call starts from it instead of scheduling."""
        return self._step(finished_only=False)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        """`step`; with `finished_only`, outputs only of the prompts that finished (generate's way: building
        every advancing prompt's output each step is host work that competes with the step's kernels)."""
        current, self._ahead = self._ahead or self._schedule_and_dispatch(), None
        if current is None:
            return []
        try:
            self._ahead = self._dispatch_ahead(current)
            results = self.runner.collect(current.groups)
            outputs = self._process_results(current.step_order, results, finished_only)
            self._settle_ahead()
        except BaseException:
            self._ahead = None
            raise
        return outputs

    def _schedule_and_dispatch(self) -> StepInFlight | None:
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        dispatched = StepInFlight.dispatch(self.runner, chunks, self.encoder_cache)
        self.scheduler.commit(chunks)
        return dispatched

    def _dispatch_ahead(self, current: StepInFlight) -> StepInFlight | None:
        if not (self.async_scheduling and len(current.groups) == 1):
            return None
        alive = [chunk for chunk in current.step_order if not chunk.request.is_finished]  # not aborted
        if not lookahead_possible(self.scheduler, alive):
            return None
        if self.drafter is not None and self.drafter.speculates(len(self.scheduler.running)) and any(
                self.drafter.has_proposal(chunk.request) for chunk in alive):
            return None  # the next step verifies drafts: it is scheduled once this step's tokens are known
        chunks = reserve_lookahead(self.scheduler, alive)
        if chunks is None:
            return None
        arrivals = self.arrivals if self.runner.dispatch_keeps_up else None
        return StepInFlight.dispatch(self.runner, chunks, self.encoder_cache, current,
                                     gate=None if arrivals is None else lambda: self._no_arrival(current, arrivals))

    def _no_arrival(self, current: StepInFlight, arrivals: Callable[[], bool]) -> bool:
        """Whether to start the prepared look-ahead step: not if a request was queued while `current` ran. That
        request starts in the next step instead, rather than after a whole decode step (its time to first token),
        so wait for the device's step first; the look-ahead step still runs while the host reads `current`. (The
        pages reserved for the look-ahead tokens serve the same tokens in the next step.)"""
        self.runner.wait_for(current.groups[0])
        return not arrivals()

    def _settle_ahead(self) -> None:
        """Commit the look-ahead rows whose request goes on (the others' results are skipped when collected);
        with none left, nothing needs the step's results."""
        if self._ahead is not None and not settle_lookahead(self.scheduler, self._ahead.chunks):
            self._ahead = None
        elif self._ahead is not None and self._ahead.groups[0].head_waits:
            # its grammars have now seen the previous step's tokens
            self.runner.finish_head(self._ahead.groups[0], self._ahead.grammar_bits())

    def _process_results(self, chunks: list[ScheduledChunk], results: dict,
                         finished_only: bool) -> list[RequestOutput]:
        advanced: dict[str, None] = {}
        for chunk in chunks:
            request = chunk.request
            result = results.get(request.request_id)
            if result is None or request.is_finished:  # finished: aborted while its step ran
                continue
            record_prompt_logprobs(request, result, self._decode_token)
            if result.token_id is None:
                continue
            status = append_sampled(chunk, result, self._decode_token, self.scheduler, self.drafter)
            if status is not None:
                self._finish(request, status)
            if status is not None or not finished_only:  # a prompt's output is final only once a step ends it
                advanced[request.group_id] = None
        outputs = []
        for group_id in advanced:
            members = self._request_groups.get(group_id)
            if members is None or (finished_only and not all(m.is_finished for m in members)):
                continue
            output = request_output(group_id, members)
            if output.finished:
                del self._request_groups[group_id]
            outputs.append(output)
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        if self.drafter is not None:
            self.drafter.finish(request)


Engine.__init__.__doc__ = (Engine.__init__.__doc__ or "") + keyword_help()
LLM = Engine

if os.environ.get("JVLLM_LOGGING_LEVEL"):
    logging.getLogger("jvllm").setLevel(os.environ["JVLLM_LOGGING_LEVEL"].upper())
