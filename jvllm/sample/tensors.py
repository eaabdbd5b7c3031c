"""Per-step sampling tensors (a device pytree of fixed shapes), the two static sampler flags, and the host builder.

Every option is a runtime value except two that need arrays of their own: penalties (each row's token history,
[S, history_width]) and token masks (a packed allowed-token bitmask [S, ceil(V/32)] from allowed / blocked
tokens and grammars, with logit biases as a fixed-width sparse list). Their flags say which processors a step runs
before the sampler; everything else (greedy or random, top-k/p/min-p, logprobs) is a device-side switch."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jvllm.sampling_params import MAX_LOGIT_BIAS_ENTRIES


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
    num_rows: jax.Array  # [] int32: the real rows, first; the head's products skip the padding rows after them
    token_index: jax.Array  # [S] int32 flat step token whose hidden state each row samples from (set by the runner)
    history: jax.Array | None = None  # [S, L] int32 prompt then output ids, -1 padded (flags.penalties)
    num_prompt: jax.Array | None = None  # [S] int32 prompt tokens at the start of each history row
    allowed_bits: jax.Array | None = None  # [S, W] int32, W = ceil(V / 32): bit t % 32 of word t // 32 allows t
    bias_ids: jax.Array | None = None  # [S, MAX_LOGIT_BIAS_ENTRIES] int32 logit_bias tokens, V = unused slot
    bias_values: jax.Array | None = None  # [S, MAX_LOGIT_BIAS_ENTRIES] float32 added at bias_ids


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static: whether the step carries token histories (penalties) and token masks (allowed bits, biases)."""

    penalties: bool = False
    masks: bool = False


def scalars_only(t: SamplingTensors) -> SamplingTensors:
    """The per-row scalars alone (what the sampler reads once the processors have run): one pytree for every
    pair of flags."""
    return dataclasses.replace(t, history=None, num_prompt=None, allowed_bits=None, bias_ids=None,
                               bias_values=None)


def penalty_inputs(t: SamplingTensors) -> SamplingTensors:
    """The scalars and the token histories (flags.penalties)."""
    return dataclasses.replace(t, allowed_bits=None, bias_ids=None, bias_values=None)


def mask_inputs(t: SamplingTensors) -> SamplingTensors:
    """The scalars and the token masks (flags.masks)."""
    return dataclasses.replace(t, history=None, num_prompt=None)


# Grammar bits that allow every token (they broadcast over a row's words): a look-ahead row's grammar narrows
# them once the previous step's token has reached it (ModelRunner.finish_head).
ALL_TOKENS = np.full(1, -1, np.int32)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's packed token bitmask."""
    return (vocab_size + 31) // 32


def pack_token_bits(allowed: np.ndarray) -> np.ndarray:
    """[V] bool -> [ceil(V/32)] int32, token t at bit t % 32 of word t // 32 (llguidance's layout)."""
    padded = np.zeros(mask_words(len(allowed)) * 32, np.bool_)
    padded[: len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


@dataclasses.dataclass
class RowSpec:
    """What the host knows about one sequence being sampled this step."""

    params: Any  # SamplingParams-like (duck typed, see _param)
    seed: int
    position: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    blocked_ids: Sequence[int] = ()
    grammar_bits: np.ndarray | None = None  # [W] int32 tokens the row's grammar allows next


def _param(params: Any, name: str, default: Any) -> Any:
    """Reads a sampling field by duck typing; None means 'use the default'."""
    value = getattr(params, name, default)
    return default if value is None else value


def _allowed_bits(params: Any, row: RowSpec, vocab_size: int) -> np.ndarray | None:
    """[W] int32 allowed-token bits of one row (allowed_token_ids, minus blocked ids, within its grammar), or
    None when every token is allowed. A grammar that allows only what min_tokens blocks (its EOS) wins."""
    allowed_ids = _param(params, "allowed_token_ids", None)
    if not allowed_ids and not len(row.blocked_ids) and row.grammar_bits is None:
        return None
    allowed = np.zeros(vocab_size, np.bool_) if allowed_ids else np.ones(vocab_size, np.bool_)
    if allowed_ids:
        allowed[np.asarray(allowed_ids, np.int64)] = True
    if len(row.blocked_ids):
        allowed[np.asarray(row.blocked_ids, np.int64)] = False
    bits = pack_token_bits(allowed)
    return bits if row.grammar_bits is None else combine_allowed_bits(bits, row.grammar_bits)


def combine_allowed_bits(bits: np.ndarray, grammar_bits: np.ndarray) -> np.ndarray:
    """[W] int32: the tokens both allow; the grammar's alone when nothing is left (min_tokens blocking the EOS
    that is a finished grammar's only way on)."""
    constrained = bits & grammar_bits
    return constrained if constrained.any() else grammar_bits


# (dtype, padding value) of each row scalar column, in _row_scalars' order
_SCALAR_COLUMNS = ((np.float32, 0.0), (np.int32, 0), (np.float32, 1.0), (np.float32, 0.0), (np.float32, 0.0),
                   (np.float32, 0.0), (np.float32, 1.0))


def _row_scalars(p: Any, vocab_size: int) -> tuple:
    """-> (temperature, top_k, top_p, min_p, presence, frequency, repetition penalty, wants logprobs) of a row."""
    temp = float(_param(p, "temperature", 1.0))
    if temp > 0:  # SamplingParams sets greedy requests' temperature to exactly 0
        # Truncation only matters for random rows: greedy rows keep it off, so an all-greedy step skips it.
        k = int(_param(p, "top_k", 0))
        truncation = (k if 0 < k < vocab_size else 0,  # -1 (vLLM's spelling) and k >= vocab keep every token
                      float(_param(p, "top_p", 1.0)), float(_param(p, "min_p", 0.0)))
    else:
        temp, truncation = 0.0, (0, 1.0, 0.0)
    return (temp, *truncation, float(_param(p, "presence_penalty", 0.0)),
            float(_param(p, "frequency_penalty", 0.0)), float(_param(p, "repetition_penalty", 1.0)),
            _param(p, "logprobs", None) is not None)


def _padded(values: list, rows: int, dtype: Any, pad: Any) -> np.ndarray:
    """[rows] array: `values`, then `pad`."""
    out = np.full(rows, pad, dtype)
    out[: len(values)] = values
    return out


def build_sampling_tensors(rows: list[RowSpec], num_padded_rows: int, *, vocab_size: int,
                           history_width: int) -> tuple[SamplingTensors, SamplerFlags]:
    """Host (numpy) tensors and static flags for a step; rows past len(rows) are padding: greedy, no feature."""
    s = num_padded_rows
    if s < len(rows):
        raise ValueError(f"num_padded_rows={s} < number of rows {len(rows)}")
    by_params: dict[int, tuple] = {}  # id(params) -> its scalars, once per request or per generate call's params
    columns = []
    for row in rows:
        column = by_params.get(id(row.params))
        if column is None:
            column = by_params[id(row.params)] = _row_scalars(row.params, vocab_size)
        columns.append(column)
    temperature, top_k, top_p, min_p, presence, frequency, repetition = (
        _padded([column[c] for column in columns], s, dtype, pad)
        for c, (dtype, pad) in enumerate(_SCALAR_COLUMNS))
    seeds = _padded([int(row.seed) & 0xFFFFFFFF for row in rows], s, np.uint32, 0)  # keys take 32-bit seeds
    positions = _padded([int(row.position) for row in rows], s, np.int32, 0)
    any_logprobs = any(column[-1] for column in columns)
    bit_rows: dict[int, np.ndarray] = {}
    bias_rows: dict[int, dict[int, float]] = {}
    for i, row in enumerate(rows):
        bits = _allowed_bits(row.params, row, vocab_size)
        if bits is not None:
            bit_rows[i] = bits
        bias = _param(row.params, "logit_bias", None)
        if bias:
            bias_rows[i] = bias
    penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
    tensors = SamplingTensors(
        temperature, top_k, top_p, min_p, presence, frequency, repetition, seeds, positions,
        any_random=np.asarray((temperature > 0).any()),
        any_top_k_p=np.asarray(((top_k > 0) | (top_p < 1) | (min_p > 0)).any()),
        any_logprobs=np.asarray(any_logprobs), num_rows=np.asarray(len(rows), np.int32),
        token_index=np.zeros(s, np.int32))
    if penalties:
        tensors.history = np.full((s, history_width), -1, np.int32)
        tensors.num_prompt = np.zeros(s, np.int32)
        for i, row in enumerate(rows):
            ids = [*row.prompt_ids, *row.output_ids]
            tensors.history[i, : len(ids)] = ids
            tensors.num_prompt[i] = len(row.prompt_ids)
    masks = bool(bit_rows or bias_rows)
    if masks:
        tensors.allowed_bits, tensors.bias_ids, tensors.bias_values = empty_masks(s, vocab_size)
        for i, bits in bit_rows.items():
            tensors.allowed_bits[i] = bits
        for i, bias in bias_rows.items():
            tensors.bias_ids[i, : len(bias)] = [int(token) for token in bias]
            tensors.bias_values[i, : len(bias)] = [float(value) for value in bias.values()]
    return tensors, SamplerFlags(penalties=penalties, masks=masks)


def empty_masks(rows: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks that change nothing: every token allowed ([S, W] int32), no biases ([S, B] int32 and float32)."""
    return (np.full((rows, mask_words(vocab_size)), -1, np.int32),
            np.full((rows, MAX_LOGIT_BIAS_ENTRIES), vocab_size, np.int32),
            np.zeros((rows, MAX_LOGIT_BIAS_ENTRIES), np.float32))
