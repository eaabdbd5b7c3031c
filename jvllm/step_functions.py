"""The jitted device steps of one model: forward + sample, the pool write, and all-position logits.

Built once per runner with the model's graphdef and weight tree structure closed over, so a call hashes
no graphdef and flattens no NNX state: the per-step host cost is a flat list of weight arrays."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from flax import nnx

from jvllm.attention import AttentionBackend
from jvllm.attention.metadata import AttentionMetadata
from jvllm.logprobs import blocked_logprob_stats, logprob_stats
from jvllm.sampler import sample
from jvllm.sampling_tensors import SamplerFlags, SamplingTensors

# (q [T,H,hd], k/v [T,KVH,hd], (k_pages, v_pages) [N,page,KVH,hd], md, scale, window) -> (out [T,H,hd], per-layer
# result): a split backend returns this step's (k, v) for the writer, a fused one the updated pages.
LayerAttention = Callable[..., tuple[jax.Array, tuple[jax.Array, jax.Array]]]


def layer_attention(backend: AttentionBackend) -> LayerAttention:
    """Adapt a backend to the one call the model makes per layer."""
    if backend.fused:
        def fused(q, k, v, pages, md, scale, sliding_window=None):
            out, k_pages, v_pages = backend.write_and_attend(q, k, v, pages[0], pages[1], md, scale, sliding_window)
            return out, (k_pages, v_pages)
        return fused

    def split(q, k, v, pages, md, scale, sliding_window=None):
        return backend.attend(q, k, v, pages[0], pages[1], md, scale, sliding_window), (k, v)
    return split


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """forward_sample(weights, kv_cache, ids, positions, md, sampling, prompt_targets, flags=, num_logprobs=,
    num_prompt_logprobs=) -> ({token_ids [S], logprobs [S], sample_stats?, prompt_stats?}, kv); `kv` is the new
    pool when `fused`, else the step's K/V for `write_pool(kv_cache, kv, md)`.
    all_logits(weights, kv_cache, ids, positions, md) -> ([T, V] float32, kv)."""

    forward_sample: Callable[..., Any]
    write_pool: Callable[..., Any] | None
    all_logits: Callable[..., Any]
    fused: bool


def build_step_functions(graphdef: Any, treedef: Any, backend: AttentionBackend) -> StepFunctions:
    attention = layer_attention(backend)
    donate = ("kv_cache",) if backend.fused else ()

    def model_of(weights: list[jax.Array]) -> Any:
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

    @functools.partial(jax.jit, static_argnames=("flags", "num_logprobs", "num_prompt_logprobs"),
                       donate_argnames=donate)
    def forward_sample(weights: list[jax.Array], kv_cache: list, input_ids: jax.Array, positions: jax.Array,
                       md: AttentionMetadata, sampling: SamplingTensors, prompt_targets: jax.Array, *,
                       flags: SamplerFlags, num_logprobs: int | None = None, num_prompt_logprobs: int | None = None):
        """prompt_targets [T] int32: the next prompt token after each row (for prompt logprobs)."""
        model = model_of(weights)
        hidden, layer_kv = model(input_ids, positions, kv_cache, md, attention)  # [T, D]
        logits = model.compute_logits(hidden[md.last_token_index])  # [S, V] float32
        token_ids, logprobs = sample(logits, sampling, flags)
        out = {"token_ids": token_ids, "logprobs": logprobs}
        if num_logprobs is not None:
            out["sample_stats"] = logprob_stats(logits, token_ids, num_logprobs)
        if num_prompt_logprobs is not None:
            out["prompt_stats"] = blocked_logprob_stats(hidden, prompt_targets, num_prompt_logprobs,
                                                        model.compute_logits)
        return out, layer_kv

    write_pool = None
    if not backend.fused:
        @functools.partial(jax.jit, donate_argnames=("kv_cache",))
        def write_pool(kv_cache: list, new_kv: list, md: AttentionMetadata) -> list:
            """Scatter a step's K/V into the donated pool, in place (its own jit: see attention/xla.py)."""
            return backend.write(kv_cache, new_kv, md)

    @functools.partial(jax.jit, donate_argnames=donate)
    def all_logits(weights: list[jax.Array], kv_cache: list, input_ids: jax.Array, positions: jax.Array,
                   md: AttentionMetadata):
        model = model_of(weights)
        hidden, layer_kv = model(input_ids, positions, kv_cache, md, attention)
        return model.compute_logits(hidden), layer_kv

    return StepFunctions(forward_sample, write_pool, all_logits, backend.fused)
