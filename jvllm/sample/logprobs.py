"""Log-probabilities: top-k and target-token stats on device, vLLM's per-position dicts on the host.

Logprobs are of the raw model distribution (log_softmax of the unprocessed logits), as vLLM reports by
default: temperature, penalties and truncation do not change them."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.outputs import Logprob

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI allows at most 20 top_logprobs
_PROMPT_BLOCK = 256  # prompt rows per block: bounds the [rows, V] logits a long prompt materializes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogprobStats:
    """For R rows: the log-probability and rank of a target token, and the top-k candidates."""

    target_logprob: jax.Array  # [R] float32
    target_rank: jax.Array  # [R] int32, 1 = most likely
    top_ids: jax.Array  # [R, K] int32
    top_logprobs: jax.Array  # [R, K] float32


def logprob_stats(logits: jax.Array, target_ids: jax.Array, k: int) -> LogprobStats:
    """logits [R, V], target_ids [R] int32 -> stats with K = k (k may be 0)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [R, V]
    safe_targets = jnp.clip(target_ids, 0, logits.shape[-1] - 1)
    target = jnp.take_along_axis(log_probs, safe_targets[:, None], axis=-1)[:, 0]  # [R]
    rank = 1 + jnp.sum(log_probs > target[:, None], axis=-1, dtype=jnp.int32)  # [R]
    if k:
        top_logprobs, top_ids = jax.lax.top_k(log_probs, k)  # [R, K]
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return LogprobStats(target, rank, top_ids.astype(jnp.int32), top_logprobs)


def blocked_logprob_stats(hidden: jax.Array, target_ids: jax.Array, k: int,
                          compute_logits: Callable[[jax.Array], jax.Array]) -> LogprobStats:
    """hidden [T, D] (T a power-of-two bucket), targets [T] -> stats for every row, computed in row blocks so a
    long prompt never holds a whole [T, V] logits array."""
    rows, dim = hidden.shape
    block = min(rows, _PROMPT_BLOCK)
    if rows % block:
        return logprob_stats(compute_logits(hidden), target_ids, k)
    blocks = (hidden.reshape(rows // block, block, dim), target_ids.reshape(rows // block, block))
    stats = jax.lax.map(lambda b: logprob_stats(compute_logits(b[0]), b[1], k), blocks)
    return jax.tree.map(lambda a: a.reshape(rows, *a.shape[2:]), stats)


def bucket_k(k: int) -> int:
    """Round a requested top-k up to a few static sizes, so a new k rarely means a new compile."""
    for size in (0, 1, 2, 5, 10, MAX_LOGPROBS):
        if k <= size:
            return size
    raise ValueError(f"at most {MAX_LOGPROBS} logprobs per token, got {k}")


@dataclasses.dataclass
class TokenLogprobs:
    """One position's stats on the host: the target's logprob and rank, and the top (id, logprob) pairs."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]

    def as_dict(self, token_id: int, k: int, decode: Callable[[int], str]) -> dict[int, Logprob]:
        """vLLM's form: the target token first, then the k most likely (ranks 1..k), deduplicated."""
        entries = {token_id: Logprob(self.logprob, self.rank, decode(token_id))}
        for rank, (candidate, logprob) in enumerate(self.top[:k], start=1):
            entries.setdefault(candidate, Logprob(logprob, rank, decode(candidate)))
        return entries


def host_rows(stats: LogprobStats, rows: list[int]) -> list[TokenLogprobs]:
    """Pull the given rows of device stats to the host (one transfer per field)."""
    logprob, rank = np.asarray(stats.target_logprob), np.asarray(stats.target_rank)
    top_ids, top_lp = np.asarray(stats.top_ids), np.asarray(stats.top_logprobs)
    return [TokenLogprobs(float(logprob[r]), int(rank[r]), list(zip(top_ids[r].tolist(), top_lp[r].tolist())))
            for r in rows]
