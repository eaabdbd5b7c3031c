"""On-device, jit-compatible token sampler: penalties, biases, token masks, greedy, temperature, top-k/p, min-p."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from cpu_kernels.build import available as kernels_available
from jvllm.sample.order_search import kth_largest, lowest_with_mass_above_below, order_keys
from jvllm.sample.tensors import RowSpec, SamplerFlags, SamplingTensors, build_sampling_tensors
from jvllm.utils import cdiv

__all__ = ["RowSpec", "SamplerFlags", "SamplingTensors", "apply_penalties", "apply_token_masks",
           "apply_top_k_top_p_min_p", "build_sampling_tensors", "draw_from_logits", "process_logits", "row_argmax",
           "sample", "sample_processed"]

_NEG_INF = -jnp.inf


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
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
    """First index of each row's maximum, like jnp.argmax over the last axis, NaN counting as +inf: [S, V] -> [S]
    int32. Lowered for XLA CPU with the native kernels, one pass over each row (cpu_kernels.row_argmax); elsewhere
    `blocked_row_argmax`."""
    if x.dtype == jnp.float32 and jax.default_backend() == "cpu" and kernels_available():
        from cpu_kernels.row_argmax import row_argmax as native_row_argmax

        return jax.lax.platform_dependent(x, cpu=native_row_argmax,
                                          default=functools.partial(blocked_row_argmax, block=block))
    return blocked_row_argmax(x, block)


def blocked_row_argmax(x: jax.Array, block: int = 128) -> jax.Array:
    """row_argmax in jnp: [S, V] -> [S] int32.

    XLA CPU lowers argmax to a (value, index) reduction that does not vectorize: 8.5 ms over [64, 49152]
    float32, against 0.7 ms here. Plain max-reductions find the block holding the first maximum, then one
    small argmax runs inside that block. NaN counts as +inf (XLA CPU's max-reduction skips NaN): a block whose
    sum is NaN holds a NaN (or both infinities, whose maximum is +inf anyway), and the winning block's NaNs are
    replaced. The reductions read the input as it is: a select before them would make XLA write a copy of all
    [S, V] logits for its reduction kernels to read."""
    rows, vocab = x.shape
    num_blocks = cdiv(vocab, block)
    if num_blocks * block != vocab:
        x = jnp.pad(x, ((0, 0), (0, num_blocks * block - vocab)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, num_blocks, block)  # [S, NB, B]
    block_max = jnp.where(jnp.isnan(blocks.sum(axis=-1)), jnp.inf, blocks.max(axis=-1))  # [S, NB]
    first_block = jnp.argmax(block_max, axis=-1)  # [S]: the first block reaching the row maximum
    winner = _nan_as_inf(jnp.take_along_axis(blocks, first_block[:, None, None], axis=1)[:, 0])  # [S, B]
    return (first_block * block + jnp.argmax(winner, axis=-1)).astype(jnp.int32)


def _nan_as_inf(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isnan(x), jnp.inf, x)


def process_logits(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """The temperature-independent processors, what greedy rows take the argmax of: [S, V] -> [S, V] float32."""
    logits = logits.astype(jnp.float32)
    if flags.penalties:
        logits = apply_penalties(logits, t)
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


# Truncation looks for its thresholds among each row's 256 largest logits first (lax.top_k) and searches whole
# rows (order_search: 32 passes, no sort) only when some row's top-k or top-p set reaches past them: on XLA CPU a
# whole-row sort costs a 64-row step about a second, the head and the search tens of milliseconds
# (docs/design/step_shapes.md, sampling on device).
CANDIDATES = (256,)
SEARCH_GROUP_ROWS = 8


def apply_top_k_top_p_min_p(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """Truncates temperature-scaled logits [S, V] to -inf outside top-k, top-p and min-p.

    Each filter yields one per-row logit threshold, read off the row's logits in descending order; the final
    mask is `scaled >= max(thresholds)`. A disabled filter's threshold is -inf, so rows not using a filter come
    back bit-identical. Ties at a threshold are all kept.
    """
    top = jnp.max(scaled, axis=-1)  # [S]
    # Each row's total softmax mass relative to its maximum, for top-p over an untruncated row.
    row_mass = jnp.sum(jnp.exp(scaled - jnp.where(jnp.isfinite(top), top, 0.0)[:, None]), axis=-1)  # [S]
    widths = tuple(w for w in CANDIDATES if w < scaled.shape[-1])
    thresholds = _truncation_thresholds(scaled, t, row_mass, widths)  # [S] float32
    return jnp.where(scaled >= thresholds[:, None], scaled, _NEG_INF)  # [S, V] float32


def _truncation_thresholds(scaled: jax.Array, t: SamplingTensors, row_mass: jax.Array,
                           widths: tuple[int, ...]) -> jax.Array:
    """Thresholds from the first head width that holds every row's kept set; whole rows searched past the last."""
    vocab = scaled.shape[-1]
    if not widths:
        return _searched_thresholds(scaled, t, row_mass)
    # The barrier keeps XLA from turning top_k into a whole-row sort once it sees only some columns are read.
    head = jax.lax.optimization_barrier(jax.lax.top_k(scaled, widths[0])[0])  # [S, K] descending
    thresholds, complete = _thresholds(head, t, vocab, row_mass)
    return jax.lax.cond(jnp.all(complete), lambda: thresholds,
                        lambda: _truncation_thresholds(scaled, t, row_mass, widths[1:]))


def _thresholds(head: jax.Array, t: SamplingTensors, vocab: int, row_mass: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """head [S, K]: each row's K largest logits, descending; row_mass [S]: the row's sum of exp(logit - max).
    -> the truncation threshold [S] float32, and whether the head held every token the threshold depends on
    [S] bool (when not, the threshold is wrong and the caller searches the whole row)."""
    width = head.shape[-1]
    # top-k: the k-th largest logit.
    k = _top_k_or_vocab(t.top_k, vocab)  # [S] int32
    kth = jnp.take_along_axis(head, (jnp.minimum(k, width) - 1)[:, None], axis=-1)[:, 0]  # [S] float32
    thr_k = jnp.where(k < vocab, kth, _NEG_INF)  # [S] float32

    # top-p on the distribution left after top-k (renormalized).
    in_k = head >= thr_k[:, None]  # [S, K] bool
    probs = _kept_probs(head, head[:, 0], thr_k, k, vocab, row_mass)  # [S, K] float32
    # A token is kept while the mass strictly above it is < p: this is the smallest
    # prefix reaching p, and the top token (mass above = 0) is always kept.
    reached = prefix_sums(probs)  # [S, K]
    keep_p = (reached - probs < t.top_p[:, None]) & in_k  # [S, K] bool
    n_keep = jnp.maximum(jnp.sum(keep_p, axis=-1), 1)  # [S] int32
    pth = jnp.take_along_axis(head, (n_keep - 1)[:, None], axis=-1)[:, 0]  # [S] float32
    # top_p >= 1 must be a no-op even when float cumsum reaches 1.0 early.
    thr_p = jnp.where(t.top_p < 1.0, pth, _NEG_INF)  # [S] float32

    complete = ((k >= vocab) | (k <= width)) & (
        (t.top_p >= 1.0) | (k <= width) | (reached[:, -1] >= t.top_p))  # [S] bool
    return jnp.maximum(jnp.maximum(thr_k, thr_p), _min_p_threshold(head[:, 0], t.min_p)), complete


def _searched_thresholds(scaled: jax.Array, t: SamplingTensors, row_mass: jax.Array) -> jax.Array:
    """_thresholds' thresholds for whole rows [S, V], each found by a search over the row's float order (the
    k-th largest logit; the smallest logit with less than top_p of the kept mass above it) -> [S] float32.
    On CPUs, groups of up to SEARCH_GROUP_ROWS rows are searched one after another, so that a group's rows stay in
    cache through the search's passes; accelerators take every row in each pass."""
    rows, vocab = scaled.shape
    group = math.gcd(rows, SEARCH_GROUP_ROWS) if jax.default_backend() == "cpu" else rows
    k = _top_k_or_vocab(t.top_k, vocab)  # [S] int32
    per_row = (scaled, k, t.top_p, t.min_p, row_mass)
    thresholds = jax.lax.map(lambda args: _group_thresholds(*args),
                             tuple(a.reshape(rows // group, group, *a.shape[1:]) for a in per_row))
    return thresholds.reshape(rows)


def _group_thresholds(scaled: jax.Array, k: jax.Array, top_p: jax.Array, min_p: jax.Array, row_mass: jax.Array
                      ) -> jax.Array:
    """_searched_thresholds for one group of rows: scaled [G, V], k (vocab: off), top_p, min_p, row_mass [G]."""
    vocab = scaled.shape[-1]
    keys = order_keys(scaled)  # [G, V] uint32

    def no_thresholds() -> jax.Array:
        return jnp.full(k.shape, _NEG_INF, jnp.float32)

    thr_k = jax.lax.cond(jnp.any(k < vocab), lambda: jnp.where(k < vocab, kth_largest(keys, k), _NEG_INF),
                         no_thresholds)  # [G] float32
    top = jnp.max(scaled, axis=-1)  # [G]
    probs = _kept_probs(scaled, top, thr_k, k, vocab, row_mass)  # [G, V] float32
    thr_p = jax.lax.cond(jnp.any(top_p < 1.0),
                         lambda: jnp.where(top_p < 1.0, lowest_with_mass_above_below(keys, probs, top_p), _NEG_INF),
                         no_thresholds)  # [G] float32
    return jnp.maximum(jnp.maximum(thr_k, thr_p), _min_p_threshold(top, min_p))


def _kept_probs(logits: jax.Array, top: jax.Array, thr_k: jax.Array, k: jax.Array, vocab: int,
                row_mass: jax.Array) -> jax.Array:
    """The distribution top-p reads: logits [S, N] at or above the top-k threshold thr_k [S], softmax-weighted
    from each row's largest logit `top` [S] and renormalized over the kept set (over the whole row, row_mass [S],
    where top-k is off, k == vocab) -> [S, N] float32."""
    first = jnp.where(jnp.isfinite(top), top, 0.0)  # [S]
    weights = jnp.where(logits >= thr_k[:, None], jnp.exp(logits - first[:, None]), 0.0)  # [S, N]
    total = jnp.where(k < vocab, jnp.sum(weights, axis=-1), row_mass)  # [S]: the kept set's mass
    return weights / total[:, None]


def _top_k_or_vocab(top_k: jax.Array, vocab: int) -> jax.Array:
    """Each row's top-k [S] int32, `vocab` where top-k is off."""
    return jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)


def _min_p_threshold(top: jax.Array, min_p: jax.Array) -> jax.Array:
    """min-p as a logit threshold from each row's largest logit `top` [S]: prob >= min_p * max_prob <=> logit >=
    max_logit + log(min_p). Probability ratios survive renormalization, so applying it after top-k/p with the
    unfiltered max is exact. -> [S] float32, -inf where min-p is off."""
    safe_min_p = jnp.maximum(min_p, jnp.finfo(jnp.float32).tiny)  # [S] float32
    return jnp.where(min_p > 0, top + jnp.log(safe_min_p), _NEG_INF)


def _row_uniforms(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row, keyed only by (seed, position): independent of batch layout. [S] float32.

    A counter-based integer hash (two rounds of multiply-xorshift mixing, seed and position folded in turn)
    rather than jax.random's threefry: one number per row needs no cryptographic strength, and threefry's
    rounds compile into while loops that cost a large share of the sampler's compile time."""
    state = _mix32(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    state = _mix32(state ^ positions.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B))
    return (state >> 8).astype(jnp.float32) * jnp.float32(1.0 / (1 << 24))  # 24 random bits: exact in float32


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit avalanche mixer (each input bit flips about half the output bits): [S] uint32 -> [S] uint32."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def prefix_sums(x: jax.Array, block: int = 128) -> jax.Array:
    """Inclusive cumulative sums along the last axis, as jnp.cumsum: [S, N] float32 -> [S, N] float32.

    Two levels of products with a triangular matrix of ones (within blocks of `block`, then over the block
    totals) instead of XLA's cumsum, which CPU lowers to chains of reduce-windows that each compile separately.
    HIGHEST precision keeps GPUs from rounding the float32 sums to tf32."""
    rows, n = x.shape
    if n <= block:
        return jnp.matmul(x, _upper_ones(n), precision=jax.lax.Precision.HIGHEST)
    num_blocks = cdiv(n, block)
    padded = jnp.pad(x, ((0, 0), (0, num_blocks * block - n))).reshape(rows, num_blocks, block)  # [S, NB, B]
    within = jnp.matmul(padded, _upper_ones(block), precision=jax.lax.Precision.HIGHEST)  # [S, NB, B]
    totals = within[:, :, -1]  # [S, NB]
    before = prefix_sums(totals, block) - totals  # [S, NB]: the sum of every earlier block
    return (within + before[:, :, None]).reshape(rows, -1)[:, :n]


def _upper_ones(n: int) -> jax.Array:
    """[n, n] float32 with ones on and above the diagonal: x @ it sums x[:j + 1] into column j."""
    index = jnp.arange(n)
    return (index[:, None] <= index[None, :]).astype(jnp.float32)


def draw_from_logits(scaled: jax.Array, uniforms: jax.Array, fallback: jax.Array, block: int = 128) -> jax.Array:
    """An inverse-CDF draw from softmax(scaled) per row: scaled [S, V], uniforms [S] in [0, 1) -> [S] int32.

    Two levels keep it cheap on every backend: the block whose running mass passes `u * total` (block sums and a
    cumulative sum over V / block entries), then the token inside that one block. One exp per logit and one
    random number per row, where Gumbel-max needs a random number per logit (random bits cost ~40x the exp on
    CPU). Tokens of zero probability (-inf) are never drawn. Rows
    with no finite mass (all -inf, NaN, +inf) take `fallback` [S] int32 (the greedy ids)."""
    rows, vocab = scaled.shape
    num_blocks = cdiv(vocab, block)
    if num_blocks * block != vocab:
        scaled = jnp.pad(scaled, ((0, 0), (0, num_blocks * block - vocab)), constant_values=-jnp.inf)
    top = jnp.max(scaled, axis=-1)  # [S]
    weights = jnp.exp(scaled - jnp.where(jnp.isfinite(top), top, 0.0)[:, None])  # [S, V'] in [0, 1]
    weights = weights.reshape(rows, num_blocks, block)  # [S, NB, B]
    block_mass = weights.sum(axis=-1)  # [S, NB]
    block_cdf = prefix_sums(block_mass)  # [S, NB]
    total = block_cdf[:, -1]  # [S]
    target = uniforms * total  # [S], below total
    chosen_block = _first_above(block_cdf, target, block_mass)  # [S]
    before = jnp.take_along_axis(block_cdf - block_mass, chosen_block[:, None], axis=-1)[:, 0]  # [S]
    inside = jnp.take_along_axis(weights, chosen_block[:, None, None], axis=1)[:, 0]  # [S, B]
    token = _first_above(prefix_sums(inside), jnp.maximum(target - before, 0.0), inside)  # [S]
    drawn = (chosen_block * block + token).astype(jnp.int32)
    return jnp.where(jnp.isfinite(total) & (total > 0), drawn, fallback)


def _first_above(cdf: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
    """The first entry whose running sum passes target, never one of zero mass: [S, N], [S], [S, N] -> [S]."""
    count = jnp.sum(cdf <= target[:, None], axis=-1)  # [S]: entries at or below target
    last_with_mass = jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[-1]), 0), axis=-1)  # [S]
    return jnp.minimum(count, last_with_mass)  # rounding can leave target at or past the last sum


def sample(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """Samples one token per row: logits [S, V] -> token_ids [S] int32. `flags` must be static under jit; the
    rest are device values, so an all-greedy step runs no sampling and a step without truncation no sort.

    The chosen token's logprob is not computed here: a full-vocab log-softmax costs 2-4 ms per 64-row step on
    CPU, so only steps with requests asking for logprobs pay it (`jvllm.sample.logprobs`), as in vLLM."""
    return sample_processed(process_logits(logits, t, flags), t)


def sample_processed(processed: jax.Array, t: SamplingTensors) -> jax.Array:
    """`sample` after the processors (penalties, token masks) have run: processed [S, V] -> token_ids [S] int32.
    Reads only the per-row scalars of `t`, so one compiled sampler serves every pair of sampler flags."""
    processed = processed.astype(jnp.float32)
    greedy_ids = row_argmax(processed)  # [S] int32
    is_greedy = t.temperature == 0  # [S] bool

    def random_ids() -> jax.Array:
        temp = jnp.where(is_greedy, 1.0, t.temperature)  # greedy rows divide by 1 to stay finite
        scaled = processed / temp[:, None]  # [S, V] float32
        scaled = jax.lax.cond(t.any_top_k_p, apply_top_k_top_p_min_p, lambda x, _: x, scaled, t)
        drawn = draw_from_logits(scaled, _row_uniforms(t.seeds, t.positions), greedy_ids)  # [S] int32
        return jnp.where(is_greedy, greedy_ids, drawn)

    return jax.lax.cond(t.any_random, random_ids, lambda: greedy_ids)
