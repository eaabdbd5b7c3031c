"""Per-step sampling tensors (a device pytree of fixed shapes), the two static sampler flags, and the host builder.

Every option is a runtime value except two that need arrays of their own: penalties (each row's token history,
[S, history_width]) and logit biases / allowed / blocked tokens (a dense [S, V] addend). Their flags pick one of
four compiled samplers per step shape; everything else (greedy or random, top-k/p/min-p, logprobs) is a
device-side switch."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step of S rows (padding rows are greedy and plain)."""

    temperature: jax.Array  # [S] float32; 0 => greedy row
    top_k: jax.Array  # [S] int32; 0 => disabled
    top_p: jax.Array  # [S] float32; 1.0 => disabled
    min_p: jax.Array  # [S] float32; 0.0 => disabled
    presence_penalty: jax.Array  # [S] float32
    frequency_penalty: jax.Array  # [S] float32
    repetition_penalty: jax.Array  # [S] float32; 1.0 => off
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32; sequence index of the token being sampled
    any_random: jax.Array  # [] bool: some row has temperature > 0
    any_top_k_p: jax.Array  # [] bool: some random row truncates
    any_logprobs: jax.Array  # [] bool: some row asks for the sampled token's logprobs
    history: jax.Array | None = None  # [S, L] int32 prompt then output ids, -1 padded (flags.penalties)
    num_prompt: jax.Array | None = None  # [S] int32 prompt tokens at the start of each history row
    bias: jax.Array | None = None  # [S, V] float32 added to the logits, -inf forbids (flags.bias)


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static: whether the step carries token histories (penalties) and a logit addend (biases, masks)."""

    penalties: bool = False
    bias: bool = False


@dataclasses.dataclass
class RowSpec:
    """What the host knows about one sequence being sampled this step."""

    params: Any  # SamplingParams-like (duck typed, see _param)
    seed: int
    position: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    blocked_ids: Sequence[int] = ()


def _param(params: Any, name: str, default: Any) -> Any:
    """Reads a sampling field by duck typing; None means 'use the default'."""
    value = getattr(params, name, default)
    return default if value is None else value


def _bias_row(params: Any, blocked: Sequence[int], vocab_size: int) -> np.ndarray | None:
    """[V] float32 addend: -inf outside allowed_token_ids, + logit_bias, -inf on blocked ids; None if nothing."""
    allowed = _param(params, "allowed_token_ids", None)
    bias = _param(params, "logit_bias", {}) or {}
    if not allowed and not bias and not len(blocked):
        return None
    row = np.zeros(vocab_size, np.float32)
    if allowed:
        row[:] = -np.inf
        row[np.asarray(allowed, np.int64)] = 0.0
    for token, value in bias.items():
        row[int(token)] += float(value)
    if len(blocked):
        row[np.asarray(blocked, np.int64)] = -np.inf
    return row


def build_sampling_tensors(rows: list[RowSpec], num_padded_rows: int, *, vocab_size: int,
                           history_width: int) -> tuple[SamplingTensors, SamplerFlags]:
    """Host (numpy) tensors and static flags for a step; rows past len(rows) are padding: greedy, no feature."""
    s = num_padded_rows
    if s < len(rows):
        raise ValueError(f"num_padded_rows={s} < number of rows {len(rows)}")
    temperature = np.zeros(s, np.float32)
    top_k = np.zeros(s, np.int32)
    top_p = np.ones(s, np.float32)
    min_p = np.zeros(s, np.float32)
    presence = np.zeros(s, np.float32)
    frequency = np.zeros(s, np.float32)
    repetition = np.ones(s, np.float32)
    seeds = np.zeros(s, np.uint32)
    positions = np.zeros(s, np.int32)
    any_logprobs = False
    bias_rows: dict[int, np.ndarray] = {}
    for i, row in enumerate(rows):
        p = row.params
        temp = float(_param(p, "temperature", 1.0))
        if temp > 0:  # SamplingParams sets greedy requests' temperature to exactly 0
            temperature[i] = temp
            # Truncation only matters for random rows: greedy rows keep it off, so an all-greedy step skips it.
            k = int(_param(p, "top_k", 0))
            top_k[i] = k if 0 < k < vocab_size else 0  # -1 (vLLM's spelling) and k >= vocab keep every token
            top_p[i] = float(_param(p, "top_p", 1.0))
            min_p[i] = float(_param(p, "min_p", 0.0))
        presence[i] = float(_param(p, "presence_penalty", 0.0))
        frequency[i] = float(_param(p, "frequency_penalty", 0.0))
        repetition[i] = float(_param(p, "repetition_penalty", 1.0))
        seeds[i] = int(row.seed) & 0xFFFFFFFF  # keys are built from 32-bit seeds
        positions[i] = int(row.position)
        any_logprobs |= _param(p, "logprobs", None) is not None
        bias = _bias_row(p, row.blocked_ids, vocab_size)
        if bias is not None:
            bias_rows[i] = bias
    penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
    tensors = SamplingTensors(
        temperature, top_k, top_p, min_p, presence, frequency, repetition, seeds, positions,
        any_random=np.asarray((temperature > 0).any()),
        any_top_k_p=np.asarray(((top_k > 0) | (top_p < 1) | (min_p > 0)).any()),
        any_logprobs=np.asarray(any_logprobs))
    if penalties:
        tensors.history = np.full((s, history_width), -1, np.int32)
        tensors.num_prompt = np.zeros(s, np.int32)
        for i, row in enumerate(rows):
            ids = [*row.prompt_ids, *row.output_ids]
            tensors.history[i, : len(ids)] = ids
            tensors.num_prompt[i] = len(row.prompt_ids)
    if bias_rows:
        tensors.bias = np.zeros((s, vocab_size), np.float32)
        for i, bias in bias_rows.items():
            tensors.bias[i] = bias
    return tensors, SamplerFlags(penalties=penalties, bias=bool(bias_rows))
