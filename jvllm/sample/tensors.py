"""Per-batch sampling tensors (device pytree), static sampler flags, and the host-side builder."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jvllm.utils import next_power_of_2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling parameters for one padded batch of S sequences."""

    temperature: jax.Array  # [S] float32; 0 => greedy row
    top_k: jax.Array  # [S] int32; 0 => disabled
    top_p: jax.Array  # [S] float32; 1.0 => disabled
    min_p: jax.Array  # [S] float32; 0.0 => disabled
    presence_penalty: jax.Array  # [S] float32
    frequency_penalty: jax.Array  # [S] float32
    repetition_penalty: jax.Array  # [S] float32; 1.0 => off
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32; sequence index of the token being sampled
    output_ids: jax.Array  # [S, Lo] int32; generated ids, -1 padded
    prompt_ids: jax.Array  # [S, Lp] int32; prompt ids, -1 padded
    bias_ids: jax.Array  # [S, Kb] int32; logit_bias ids, -1 padded
    bias_values: jax.Array  # [S, Kb] float32
    allowed_ids: jax.Array  # [S, Ka] int32; -1 padded; all -1 => unrestricted
    blocked_ids: jax.Array  # [S, Kx] int32; forced to -inf, -1 padded


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static switches: a False flag compiles the feature out of the jitted sampler."""

    any_random: bool = False  # some row has temperature > 0
    any_top_k_p: bool = False  # some random row uses top_k, top_p or min_p
    any_penalties: bool = False  # some row uses presence/frequency/repetition penalty
    any_bias: bool = False  # logit_bias, allowed_ids or blocked_ids present


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


def _fill_ragged(rows: list[Sequence[int]], num_rows: int, width: int) -> np.ndarray:
    """Packs variable-length id lists into a -1 padded [num_rows, width] int32 array."""
    out = np.full((num_rows, width), -1, dtype=np.int32)  # [S, W] int32
    for i, ids in enumerate(rows):
        if len(ids):
            out[i, : len(ids)] = np.asarray(ids, dtype=np.int64)
    return out


def build_sampling_tensors(
    rows: list[RowSpec], num_padded_rows: int
) -> tuple[SamplingTensors, SamplerFlags]:
    """Builds the host (numpy) tensors and static flags for a batch; the runner sends them to the device
    in the one transfer of all the step's inputs.

    Rows past len(rows) are padding: greedy with every feature disabled, so they
    cost nothing and never influence the real rows.
    """
    n = len(rows)
    s = num_padded_rows
    if s < n:
        raise ValueError(f"num_padded_rows={s} < number of rows {n}")

    temperature = np.zeros((s,), np.float32)  # [S] float32
    top_k = np.zeros((s,), np.int32)  # [S] int32
    top_p = np.ones((s,), np.float32)  # [S] float32
    min_p = np.zeros((s,), np.float32)  # [S] float32
    presence = np.zeros((s,), np.float32)  # [S] float32
    frequency = np.zeros((s,), np.float32)  # [S] float32
    repetition = np.ones((s,), np.float32)  # [S] float32
    seeds = np.zeros((s,), np.uint32)  # [S] uint32
    positions = np.zeros((s,), np.int32)  # [S] int32

    bias_ids_rows: list[list[int]] = []
    bias_val_rows: list[list[float]] = []
    allowed_rows: list[list[int]] = []
    blocked_rows: list[list[int]] = []
    output_rows: list[Sequence[int]] = []
    prompt_rows: list[Sequence[int]] = []
    need_prompt = False

    for i, row in enumerate(rows):
        p = row.params
        temp = float(_param(p, "temperature", 1.0))
        if temp > 0:  # SamplingParams sets greedy requests' temperature to exactly 0
            temperature[i] = temp
            # Truncation only matters for random rows; zeroing it on greedy rows
            # keeps any_top_k_p (and the sort) off for all-greedy batches.
            k = int(_param(p, "top_k", 0))
            top_k[i] = k if k > 0 else 0  # vLLM's -1 also means disabled
            top_p[i] = float(_param(p, "top_p", 1.0))
            min_p[i] = float(_param(p, "min_p", 0.0))
        presence[i] = float(_param(p, "presence_penalty", 0.0))
        frequency[i] = float(_param(p, "frequency_penalty", 0.0))
        repetition[i] = float(_param(p, "repetition_penalty", 1.0))
        seeds[i] = int(row.seed) & 0xFFFFFFFF  # keys are built from 32-bit seeds
        positions[i] = int(row.position)
        need_prompt |= bool(repetition[i] != 1.0)

        bias = _param(p, "logit_bias", {}) or {}
        # JSON requests carry string keys; normalize to ints.
        bias_ids_rows.append([int(tok) for tok in bias.keys()])
        bias_val_rows.append([float(v) for v in bias.values()])
        allowed_rows.append([int(tok) for tok in (_param(p, "allowed_token_ids", []) or [])])
        blocked_rows.append([int(tok) for tok in row.blocked_ids])
        output_rows.append(row.output_ids)
        prompt_rows.append(row.prompt_ids)

    random_rows = temperature > 0  # [S] bool
    flags = SamplerFlags(
        any_random=bool(random_rows.any()),
        any_top_k_p=bool(((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)).any()),
        any_penalties=bool(
            (presence != 0.0).any() or (frequency != 0.0).any() or (repetition != 1.0).any()
        ),
        any_bias=any(bias_ids_rows) or any(allowed_rows) or any(blocked_rows),
    )

    # Token-history arrays are only shipped when penalties need them; otherwise a
    # [S, 1] all -1 placeholder keeps the pytree structure fixed.
    lo = next_power_of_2(max((len(r) for r in output_rows), default=0)) if flags.any_penalties else 1
    lp = next_power_of_2(max((len(r) for r in prompt_rows), default=0)) if need_prompt else 1
    kb = next_power_of_2(max((len(r) for r in bias_ids_rows), default=0))
    ka = next_power_of_2(max((len(r) for r in allowed_rows), default=0))
    kx = next_power_of_2(max((len(r) for r in blocked_rows), default=0))

    output_ids = (
        _fill_ragged(output_rows, s, lo) if flags.any_penalties else np.full((s, 1), -1, np.int32)
    )  # [S, Lo] int32
    prompt_ids = (
        _fill_ragged(prompt_rows, s, lp) if need_prompt else np.full((s, 1), -1, np.int32)
    )  # [S, Lp] int32
    bias_ids = _fill_ragged(bias_ids_rows, s, kb)  # [S, Kb] int32
    bias_values = np.zeros((s, kb), np.float32)  # [S, Kb] float32
    for i, vals in enumerate(bias_val_rows):
        bias_values[i, : len(vals)] = vals
    allowed_ids = _fill_ragged(allowed_rows, s, ka)  # [S, Ka] int32
    blocked_ids = _fill_ragged(blocked_rows, s, kx)  # [S, Kx] int32

    return SamplingTensors(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        seeds=seeds,
        positions=positions,
        output_ids=output_ids,
        prompt_ids=prompt_ids,
        bias_ids=bias_ids,
        bias_values=bias_values,
        allowed_ids=allowed_ids,
        blocked_ids=blocked_ids,
    ), flags
