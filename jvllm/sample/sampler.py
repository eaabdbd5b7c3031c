"""On-device, jit-compatible token sampler: penalties, biases, token masks, greedy, temperature, top-k/p, min-p."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.sample.tensors import RowSpec, SamplerFlags, SamplingTensors, build_sampling_tensors
from jvllm.utils import cdiv

__all__ = ["RowSpec", "SamplerFlags", "SamplingTensors", "apply_top_k_top_p_min_p", "build_sampling_tensors",
           "process_logits", "row_argmax", "sample"]

_NEG_INF = -jnp.inf


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output only), as vLLM."""
    rows, vocab = logits.shape
    history = t.history  # [S, L] int32, -1 padded
    valid = history >= 0
    is_output = valid & (jnp.arange(history.shape[1])[None, :] >= t.num_prompt[:, None])  # [S, L]
    row_index = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], history.shape)
    columns = jnp.where(valid, history, vocab)  # padding scatters to column V: dropped
    out_counts = jnp.zeros((rows, vocab), jnp.int32).at[row_index, columns].add(
        is_output.astype(jnp.int32), mode="drop")  # [S, V]
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[row_index, columns].set(True, mode="drop")  # [S, V]
    rep = t.repetition_penalty[:, None]  # [S, 1]
    # Dividing positive / multiplying negative logits always moves them toward "less likely"; rep == 1 leaves
    # the row bit-identical.
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts.astype(jnp.float32)
    return logits - t.presence_penalty[:, None] * (out_counts > 0).astype(jnp.float32)


def row_argmax(x: jax.Array, block: int = 128) -> jax.Array:
    """First index of each row's maximum, like jnp.argmax over the last axis: [S, V] -> [S] int32.

    XLA CPU lowers argmax to a (value, index) reduction that does not vectorize: 8.5 ms over [64, 49152]
    float32, against 0.7 ms here. Plain max-reductions find the block holding the first maximum, then one
    small argmax runs inside that block. NaN counts as +inf (XLA CPU's max-reduction skips NaN); it is
    replaced inside the reductions and in the winning block only, so the [S, V] input is never copied."""
    rows, vocab = x.shape
    num_blocks = cdiv(vocab, block)
    if num_blocks * block != vocab:
        x = jnp.pad(x, ((0, 0), (0, num_blocks * block - vocab)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, num_blocks, block)  # [S, NB, B]
    block_max = _nan_as_inf(blocks).max(axis=-1)  # [S, NB]
    first_block = jnp.argmax(block_max, axis=-1)  # [S]: the first block reaching the row maximum
    winner = _nan_as_inf(jnp.take_along_axis(blocks, first_block[:, None, None], axis=1)[:, 0])  # [S, B]
    return (first_block * block + jnp.argmax(winner, axis=-1)).astype(jnp.int32)


def _nan_as_inf(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isnan(x), jnp.inf, x)


def process_logits(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """The temperature-independent processors, what greedy rows take the argmax of: [S, V] -> [S, V] float32."""
    logits = logits.astype(jnp.float32)
    if flags.penalties:
        logits = _apply_penalties(logits, t)
    if flags.masks:
        logits = apply_token_masks(logits, t)
    return logits


def apply_token_masks(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Adds each row's logit biases, then -inf on tokens its allowed-token bits leave out: [S, V] -> [S, V]."""
    rows, vocab = logits.shape
    row_index = jnp.arange(rows, dtype=jnp.int32)[:, None]  # [S, 1]
    logits = logits.at[row_index, t.bias_ids].add(t.bias_values, mode="drop")  # id V (unused slot) is dropped
    shifts = jnp.arange(32, dtype=jnp.int32)  # [32]
    bits = (t.allowed_bits[:, :, None] >> shifts) & 1  # [S, W, 32] int32
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0  # [S, V] bool
    return jnp.where(allowed, logits, _NEG_INF)


def apply_top_k_top_p_min_p(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """Truncates temperature-scaled logits [S, V] to -inf outside top-k, top-p and min-p.

    One descending sort per row yields a single per-row logit threshold for each
    filter; the final mask is `scaled >= max(thresholds)`. A disabled filter's
    threshold is -inf, so rows not using a filter come back bit-identical.
    Ties at a threshold are all kept.
    """
    vocab = scaled.shape[-1]
    sorted_desc = jnp.sort(scaled, axis=-1, descending=True)  # [S, V] float32

    # top-k: the k-th largest logit.
    k = jnp.where((t.top_k > 0) & (t.top_k < vocab), t.top_k, vocab)  # [S] int32
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)[:, 0]  # [S] float32
    thr_k = jnp.where(k < vocab, kth, _NEG_INF)  # [S] float32

    # top-p on the distribution left after top-k (renormalized by the softmax).
    in_k = sorted_desc >= thr_k[:, None]  # [S, V] bool
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, _NEG_INF), axis=-1)  # [S, V] float32
    # A token is kept while the mass strictly above it is < p: this is the smallest
    # prefix reaching p, and the top token (mass above = 0) is always kept.
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # [S, V] float32
    keep_p = (mass_above < t.top_p[:, None]) & in_k  # [S, V] bool
    n_keep = jnp.maximum(jnp.sum(keep_p, axis=-1), 1)  # [S] int32
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)[:, 0]  # [S] float32
    # top_p >= 1 must be a no-op even when float cumsum reaches 1.0 early.
    thr_p = jnp.where(t.top_p < 1.0, pth, _NEG_INF)  # [S] float32

    # min-p: prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p).
    # Probability ratios survive renormalization, so applying it after top-k/p
    # with the unfiltered max is exact.
    safe_min_p = jnp.maximum(t.min_p, jnp.finfo(jnp.float32).tiny)  # [S] float32
    thr_m = jnp.where(t.min_p > 0, sorted_desc[:, 0] + jnp.log(safe_min_p), _NEG_INF)  # [S] float32

    thr = jnp.maximum(jnp.maximum(thr_k, thr_p), thr_m)  # [S] float32
    return jnp.where(scaled >= thr[:, None], scaled, _NEG_INF)  # [S, V] float32


def _gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """Per-row Gumbel noise keyed only by (seed, position): independent of batch layout."""

    def row_noise(seed: jax.Array, position: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, (vocab,), jnp.float32)  # [V] float32

    return jax.vmap(row_noise)(seeds, positions)  # [S, V] float32


def sample(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """Samples one token per row: logits [S, V] -> token_ids [S] int32. `flags` must be static under jit; the
    rest are device values, so an all-greedy step runs no sampling and a step without truncation no sort.

    The chosen token's logprob is not computed here: a full-vocab log-softmax costs 2-4 ms per 64-row step on
    CPU, so only steps with requests asking for logprobs pay it (`jvllm.sample.logprobs`), as in vLLM."""
    processed = process_logits(logits, t, flags)  # [S, V] float32
    greedy_ids = row_argmax(processed)  # [S] int32
    is_greedy = t.temperature == 0  # [S] bool

    def random_ids() -> jax.Array:
        temp = jnp.where(is_greedy, 1.0, t.temperature)  # greedy rows divide by 1 to stay finite
        scaled = processed / temp[:, None]  # [S, V] float32
        scaled = jax.lax.cond(t.any_top_k_p, apply_top_k_top_p_min_p, lambda x, _: x, scaled, t)
        # Gumbel-max: argmax(logits + G) is an exact draw from softmax(logits), no normalization needed.
        noise = _gumbel_noise(t.seeds, t.positions, processed.shape[-1])  # [S, V] float32
        return jnp.where(is_greedy, greedy_ids, row_argmax(scaled + noise))

    return jax.lax.cond(t.any_random, random_ids, lambda: greedy_ids)
