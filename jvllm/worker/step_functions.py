"""The jitted device steps of one model: forward + sample, the pool write, and all-position logits.

Built once per runner with the model's graphdef and weight tree structure closed over, so a call hashes
no graphdef and flattens no NNX state: the per-step host cost is a flat list of weight arrays."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from flax import nnx

from jax.sharding import Mesh

from jvllm.attention import AttentionBackend
from jvllm.attention.backend import StoreFn
from models.attention import AttentionMetadata
from jvllm.sample.logprobs import blocked_logprob_stats, logprob_stats
from jvllm.parallel import ops
from jvllm.sample.sampler import sample
from jvllm.sample.tensors import SamplerFlags, SamplingTensors

@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """forward_sample(weights, kv_cache, ids, positions, md, sampling, prompt_targets, flags=, num_logprobs=,
    num_prompt_logprobs=) -> ({token_ids [S], sample_stats?, prompt_stats?}, layer results);
    all_logits(weights, kv_cache, ids, positions, md) -> ([T, V] float32, layer results);
    store_kv(kv_cache, layer results, md) -> the pool holding the step's K/V (call it after every step)."""

    forward_sample: Callable[..., Any]
    all_logits: Callable[..., Any]
    store_kv: StoreFn


def build_step_functions(graphdef: Any, treedef: Any, backend: AttentionBackend, mesh: Mesh | None = None,
                         vocab_size: int | None = None) -> StepFunctions:
    """With a mesh (tensor parallelism), weights and pool arrive sharded: attention and the pool write run
    per shard, the embedding lookup is vocab-parallel, and logits are replicated (and stripped of any vocab
    padding, past `vocab_size`) before sampling. Without one, the single-device steps are unchanged."""
    attention = backend.layer_attention(mesh)
    embed = None if mesh is None else ops.vocab_parallel_lookup(mesh)
    gather = (lambda x: x) if mesh is None else ops.replicate(mesh)
    gather_logits = None if mesh is None else ops.gather_vocab(mesh)
    donate = ("kv_cache",) if backend.step_donates_pool else ()

    def model_of(weights: list[jax.Array]) -> Any:
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

    def logits_of(model: Any) -> Callable[[jax.Array], jax.Array]:
        """hidden [S, D] -> full-vocab logits [S, V] float32, on every device."""
        if mesh is None:
            return model.compute_logits
        return lambda hidden: gather_logits(model.compute_logits(hidden))[:, :vocab_size]

    @functools.partial(jax.jit, static_argnames=("flags", "num_logprobs", "num_prompt_logprobs"),
                       donate_argnames=donate)
    def forward_sample(weights: list[jax.Array], kv_cache: list, input_ids: jax.Array, positions: jax.Array,
                       md: AttentionMetadata, sampling: SamplingTensors, prompt_targets: jax.Array, *,
                       flags: SamplerFlags, num_logprobs: int | None = None, num_prompt_logprobs: int | None = None):
        """prompt_targets [T] int32: the next prompt token after each row (for prompt logprobs)."""
        model = model_of(weights)
        hidden, layer_kv = model(input_ids, positions, kv_cache, md, attention, embed)  # [T, D]
        compute_logits = logits_of(model)
        logits = compute_logits(hidden[md.last_token_index])  # [S, V] float32
        token_ids = sample(logits, sampling, flags)  # [S] int32
        out = {"token_ids": token_ids}
        if num_logprobs is not None:
            out["sample_stats"] = logprob_stats(logits, token_ids, num_logprobs)
        if num_prompt_logprobs is not None:
            out["prompt_stats"] = blocked_logprob_stats(hidden, prompt_targets, num_prompt_logprobs,
                                                        compute_logits)
        return gather(out), layer_kv

    @functools.partial(jax.jit, donate_argnames=donate)
    def all_logits(weights: list[jax.Array], kv_cache: list, input_ids: jax.Array, positions: jax.Array,
                   md: AttentionMetadata):
        model = model_of(weights)
        hidden, layer_kv = model(input_ids, positions, kv_cache, md, attention, embed)
        return logits_of(model)(hidden), layer_kv

    return StepFunctions(forward_sample, all_logits, backend.store(mesh))
