"""The jitted pieces of one model step: embedding, a layer (one function for every layer), the head (logits, the
logit processors, the sampler), all-position logits, and the pool store. The runner compiles them ahead of
time per step shape.

Each piece closes over the static structure (graphdefs, tree structures, mesh), so a call passes only flat
weight lists and the step's arrays."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.attention import AttentionBackend
from jvllm.attention.backend import StoreFn
from jvllm.parallel import ops
from jvllm.parallel.mesh import replicated
from jvllm.sample.logprobs import MAX_LOGPROBS, LogprobStats, blocked_logprob_stats, logprob_stats
from jvllm.sample.sampler import apply_penalties, apply_token_masks, sample_processed
from jvllm.sample.tensors import SamplingTensors
from jvllm.worker.model_parts import ModelParts
from jvllm.worker.page_copy import page_copier
from models.attention import AttentionMetadata
from models.bf16_rows import native_bf16_rows
from models.live_rows import live_rows
from models.quantized import bf16_products


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """Per step shape (T tokens, S rows):
    embed(outer, ids [T], positions [T]) -> (x [T, D], cos, sin [T, hd]); a multimodal model's also takes
    mm_rows [T] int32 and the encoder buffer [R, D]: a token with a row >= 0 takes that buffer row as its embedding;
    layer(layer weights, x, cos, sin, (k_pages, v_pages), md, group=) -> (x, the attention's per-layer result), one
    function per layer group (jvllm.worker.model_parts); the body of every run below, and on its own the piece the
    CUDA-lowering tests inspect;
    layer_runs(n)(n layers' weights, x, cos, sin, n layers' pages, md, groups=) -> (x, n results): n consecutive
    layers in one executable (what the runner calls: fewer calls per step, see jvllm.worker.layer_runs);
    last_rows(x, token_index [S]) -> [S, D], the token each sampler row samples after (a chunk's last token; every
verified position of a chunk with draft tokens);
    prompt_stats(outer, x, prompt_targets [T]) -> logprob stats [T, K] of each next prompt token;
    logits(outer, x) -> [T, V] float32 at every position;
    store_kv(pool, per-layer results, md) -> the pool holding the step's K/V;
    take_ids(source ids [max_num_seqs], rows [S]) -> input ids gathered on the device;
    copy_pages(pool, sources [C], targets [C]) -> the pool with whole pages copied (jvllm.worker.page_copy).
    Per row count S alone, the head in three parts (each compiled once serves every pair of sampler flags):
    head_logits(outer, x_last [S, D], num_rows []) -> [S, V] float32 (rows past num_rows are 0);
    penalize(logits, penalty inputs) and mask_tokens(logits, mask inputs) -> [S, V] float32, the processors a
    step's flags ask for (jvllm.sample.tensors.penalty_inputs / mask_inputs);
    pick(logits, processed [S, V], per-row scalars) -> {token_ids [max_num_seqs] (rows past S are 0: every step's
    ids have one size, so a look-ahead step can read any step's), sample_stats [S, K] (of the unprocessed logits;
    zeros unless a row asked; K = MAX_LOGPROBS, each request reads its own top k)}."""

    embed: Any
    layer: Any
    layer_runs: Callable[[int], Any]
    last_rows: Any
    head_logits: Any
    penalize: Any
    mask_tokens: Any
    pick: Any
    prompt_stats: Any
    logits: Any
    store_kv: StoreFn
    take_ids: Any
    copy_pages: Any


def counted_as_work(x_in: jax.Array, x_out: jax.Array) -> jax.Array:
    """x_out (the same values) times 1 + min(|p|, 0), p from a 32 x 32 product of x_in's first values (~65k flops,
    about a microsecond): exactly 1 for any finite p, and XLA cannot drop the product.

    XLA's CPU client runs an executable on the calling thread, inside the call, when its inputs are ready and its
    cost analysis counts fewer than 1,000 flops ("cheap" computations). The native kernels are custom calls, which
    it counts as none: unmarked, a run of native layers dispatched after the previous step has ended runs inside its
    call, the host's work for the next step waits behind it instead of overlapping it, and each later step finds its
    inputs ready too (docs/design/host_loop.md). The product makes the run count as the work it is."""
    values = jnp.resize(x_in.reshape(-1)[:1024].astype(jnp.float32), (32, 32))
    one = 1.0 + jnp.minimum(jnp.abs((values @ values)[0, 0]), 0.0)
    return x_out * one.astype(x_out.dtype)


def _zero_stats(rows: int) -> LogprobStats:
    return LogprobStats(jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32),
                        jnp.zeros((rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))


def build_step_functions(parts: ModelParts, backend: AttentionBackend, activation_dtype: Any, max_num_seqs: int,
                         mesh: Mesh | None = None, vocab_size: int | None = None,
                         multimodal: bool = False, bf16_block_products: bool = True,
                         invariant_rows: int = 0, int8_block_products: bool = False,
                         one_row_bf16: bool = False) -> StepFunctions:
    """With a mesh (tensor parallelism) the weights and the pool arrive sharded: attention and the pool write
    run per shard, the embedding lookup is vocab-parallel, activations between the pieces are replicated,
    and logits are replicated (and stripped of any vocab padding past `vocab_size`) before sampling.
    `multimodal`: the embedding takes image features from the encoder buffer (replicated on a mesh).
    `bf16_block_products`: products of 2+ rows with GGUF blocks may run in bfloat16 (models.quantized);
    `invariant_rows`: steps of up to that many token rows give each row the bits it would get alone (speculative
    decoding: verification rows then give a decode step's bits; 0: no such promise);
    `int8_block_products`: products of 9+ rows with 4- and 5-bit blocks may take 8-bit activations instead;
    `one_row_bf16`: products of 1-4 token rows with bf16 weights take the native CPU kernel where it is the faster
    one (unsharded weights on CPU; models.bf16_rows)."""
    attention = backend.layer_attention(mesh)
    on_cpu = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform == "cpu"
    embed_lookup = None if mesh is None else ops.vocab_parallel_lookup(mesh)
    gather = (lambda x: x) if mesh is None else ops.replicate(mesh)
    gather_vocab = None if mesh is None else ops.gather_vocab(mesh)
    whole = None if mesh is None else replicated(mesh)

    def jit(fn: Callable, *, out_shardings: Any = None, **kwargs: Any) -> Any:
        if mesh is None:
            return jax.jit(fn, **kwargs)
        return jax.jit(fn, out_shardings=out_shardings, **kwargs)

    def logits_of(model: Any) -> Callable[[jax.Array], jax.Array]:
        """hidden [R, D] -> full-vocab logits [R, V] float32, on every device."""
        if mesh is None:
            return model.compute_logits
        return lambda hidden: gather_vocab(model.compute_logits(hidden))[:, :vocab_size]

    def embed(outer: list[jax.Array], input_ids: jax.Array, positions: jax.Array):
        return parts.outer(outer).embed(input_ids, positions, activation_dtype, embed_lookup)

    def embed_with_features(outer: list[jax.Array], input_ids: jax.Array, positions: jax.Array, mm_rows: jax.Array,
                            mm_buffer: jax.Array):
        """mm_rows [T] int32 (-1: a text token), mm_buffer [R, D]: image tokens take their encoder output rows."""
        x, cos, sin = embed(outer, input_ids, positions)
        features = mm_buffer[jnp.maximum(mm_rows, 0)].astype(x.dtype)  # [T, D]
        return jnp.where((mm_rows >= 0)[:, None], features, x), cos, sin

    @contextlib.contextmanager
    def products() -> Iterator[None]:
        """The reduced-precision products the engine allows for GGUF blocks (models.quantized.bf16_products), and
        the native few-row products with bf16 weights where they apply (models.bf16_rows)."""
        with bf16_products(bf16_block_products, invariant_rows, int8_block_products), native_bf16_rows(one_row_bf16):
            yield

    @contextlib.contextmanager
    def layer_products(x: jax.Array, md: AttentionMetadata) -> Iterator[None]:
        """A layer's products: none for padding tokens on CPU's quantized weights, in the engine's precisions."""
        with live_rows(jnp.sum(md.q_lens), x.shape[0]), products():
            yield

    def layer(weights: list[jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array, pages: tuple,
              md: AttentionMetadata, *, group: int = 0):
        with layer_products(x, md):
            return parts.layer(weights, group)(x, cos, sin, pages, md, attention)

    def layer_run(weights: list[list[jax.Array]], x: jax.Array, cos: jax.Array, sin: jax.Array, pages: list[tuple],
                  md: AttentionMetadata, *, groups: tuple[int, ...]):
        """Consecutive layers in one executable (their groups in order) -> (x, each layer's result). Where every
        layer of the run defers its residual add (models.llama.DecoderLayer.call_deferred), each layer's MLP output
        is added in the next layer's input-norm pass (the same bits, one pass over x fewer) and the last at the end.
        On a CPU the run is marked as work for XLA's CPU client (counted_as_work)."""
        x_in = x
        modules = [parts.layer(layer_weights, group) for layer_weights, group in zip(weights, groups)]
        deferred = len(modules) > 1 and all(getattr(m, "defers_residual", lambda _: False)(x) for m in modules)
        results, delta = [], None
        with layer_products(x, md):
            for module, layer_pages in zip(modules, pages):
                if deferred:
                    x, delta, result = module.call_deferred(x, delta, cos, sin, layer_pages, md, attention)
                else:
                    x, result = module(x, cos, sin, layer_pages, md, attention)
                results.append(result)
        x = x + delta if deferred else x
        return (counted_as_work(x_in, x) if on_cpu else x), results

    @functools.cache
    def layer_runs(length: int) -> Any:
        """The jitted run of `length` layers (its output layout depends on the length on a mesh)."""
        out = None if mesh is None else (whole, [backend.layer_result_sharding(mesh)] * length)
        return jit(layer_run, out_shardings=out, static_argnames=("groups",),
                   donate_argnames=("pages",) if backend.step_donates_pool else ())

    def head_logits(outer: list[jax.Array], x_last: jax.Array, num_rows: jax.Array) -> jax.Array:
        model = parts.outer(outer)
        # padding rows' logits: 0
        with live_rows(num_rows, x_last.shape[0]), products():
            return logits_of(model)(model.finish(x_last))  # [S, V] float32

    def prompt_stats(outer: list[jax.Array], x: jax.Array, prompt_targets: jax.Array) -> LogprobStats:
        """prompt_targets [T] int32: the next prompt token after each row (-1: none)."""
        model = parts.outer(outer)
        with products():
            return gather(blocked_logprob_stats(model.finish(x), prompt_targets, MAX_LOGPROBS, logits_of(model)))

    def logits(outer: list[jax.Array], x: jax.Array) -> jax.Array:
        model = parts.outer(outer)
        with products():
            return logits_of(model)(model.finish(x))

    layer_out = None if mesh is None else (whole, backend.layer_result_sharding(mesh))
    last_rows, pick = _model_free_pieces(max_num_seqs, mesh)
    return StepFunctions(
        embed=jit(embed_with_features if multimodal else embed, out_shardings=(whole, whole, whole)),
        layer=jit(layer, out_shardings=layer_out, static_argnames=("group",),
                  donate_argnames=("pages",) if backend.step_donates_pool else ()),
        layer_runs=layer_runs,
        last_rows=last_rows,
        head_logits=jit(head_logits, out_shardings=whole),
        penalize=jit(apply_penalties, out_shardings=whole),
        mask_tokens=jit(apply_token_masks, out_shardings=whole),
        pick=pick,
        prompt_stats=jit(prompt_stats, out_shardings=whole),
        logits=jit(logits, out_shardings=whole),
        store_kv=backend.store(mesh),
        take_ids=jit(_take_ids, out_shardings=whole),
        copy_pages=page_copier(mesh))


@functools.lru_cache(maxsize=16)
def _model_free_pieces(max_num_seqs: int, mesh: Mesh | None) -> tuple[Any, Any]:
    """(last_rows, pick), jitted: they read no weights and depend on the row budget and the mesh alone, so the
    engines of one process share them, and jax's tracing and lowering caches serve a later engine's row counts
    (lowering the sampler costs ~0.2 s per row count on a 2-core CPU)."""
    gather = (lambda x: x) if mesh is None else ops.replicate(mesh)
    whole = None if mesh is None else replicated(mesh)

    def last_rows(x: jax.Array, token_index: jax.Array) -> jax.Array:
        return x[token_index]

    def pick(logits: jax.Array, processed: jax.Array, sampling: SamplingTensors) -> dict[str, Any]:
        token_ids = sample_processed(processed, sampling)  # [S] int32
        sample_stats = jax.lax.cond(sampling.any_logprobs, lambda: logprob_stats(logits, token_ids, MAX_LOGPROBS),
                                    lambda: _zero_stats(logits.shape[0]))
        padded_ids = jnp.zeros(max_num_seqs, jnp.int32).at[:token_ids.shape[0]].set(token_ids)
        return gather({"token_ids": padded_ids, "sample_stats": sample_stats})

    if mesh is None:
        return jax.jit(last_rows), jax.jit(pick)
    return jax.jit(last_rows, out_shardings=whole), jax.jit(pick, out_shardings=whole)


def _take_ids(source_ids: jax.Array, rows: jax.Array) -> jax.Array:
    """source_ids [max_num_seqs] int32 (a head's ids), rows [S] int32 -> [S] int32 input ids, on the device."""
    return source_ids[rows]


__all__ = ["StepFunctions", "build_step_functions"]
