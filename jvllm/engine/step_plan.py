"""The engine's side of the step contract: scheduled chunks (live requests) -> the worker's plain ChunkPlans, the
images to encode among them with the encoder-buffer rows the EncoderCache gave them."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

import numpy as np

from jvllm.core.bad_words import banned_next
from jvllm.core.encoder_cache import EncoderCache, MultiModalItem
from jvllm.core.scheduler import ScheduledChunk
from jvllm.multimodal.positions import mrope_positions
from jvllm.sample.tensors import ALL_TOKENS, RowSpec
from jvllm.worker.batch import ChunkRow
from jvllm.worker.encoder_runner import EncoderBufferLayout
from jvllm.worker.model_runner import ModelRunner
from jvllm.worker.step_plan import ChunkPlan, EncodeItem
from jvllm.worker.step_results import DispatchedGroup


def chunk_row(chunk: ScheduledChunk, encoder_cache: EncoderCache | None = None, mrope: bool = False) -> ChunkRow:
    """`mrope`: the model takes multimodal RoPE positions, which a request's images shift."""
    request, start = chunk.request, chunk.start
    known = chunk.num_tokens - chunk.pending_tokens - len(chunk.draft_ids)
    ids = request.tokens_between(start, start + known)
    mm_rows = None
    if encoder_cache is not None and request.mm_items:
        mm_rows = encoder_cache.token_rows(request, start, chunk.num_tokens)
    positions = mrope_positions(request.mm_items, start, chunk.num_tokens) if mrope and request.mm_items else None
    return ChunkRow(ids + list(chunk.draft_ids) + [0] * chunk.pending_tokens, start, request.page_table, mm_rows,
                    positions)


def row_spec(chunk: ScheduledChunk, num_drafts: int = 0) -> RowSpec:
    """The sampler row after the chunk's last known token, or with `num_drafts` after its first drafts (the row
    sees them as output). A look-ahead chunk samples the token after the one still on the device."""
    request = chunk.request
    params = request.params
    ahead = chunk.pending_tokens + num_drafts  # tokens before this row's that the request has not appended yet
    blocked: list[int] = []
    if len(request.output_token_ids) + ahead < params.min_tokens:
        blocked = [*params.stop_token_ids, *([] if params.ignore_eos else request.eos_token_ids)]
    if request.bad_word_ids:  # a look-ahead row has only one-token ones (core.lookahead)
        depth = max(len(sequence) for sequence in request.bad_word_ids)  # the output tokens a ban can look at
        recent = [*request.output_token_ids[-depth:], *chunk.draft_ids[:num_drafts]]
        blocked += banned_next(request.bad_word_ids, recent)
    if request.grammar is None or not chunk.samples:
        grammar_bits = None
    elif chunk.lookahead:  # the grammar has not seen the token before this one yet: finish_head narrows it
        grammar_bits = ALL_TOKENS
    elif num_drafts:
        grammar_bits = chunk.draft.grammar_bits[num_drafts - 1]
    else:
        grammar_bits = request.grammar.allowed_bits()
    output_ids = request.output_token_ids
    if num_drafts and params.uses_penalties:  # penalties count the drafts before this row
        output_ids = [*output_ids, *chunk.draft_ids[:num_drafts]]
    return RowSpec(params=params, seed=request.seed, position=request.num_tokens + ahead,
                   prompt_ids=request.prompt_token_ids, output_ids=output_ids, blocked_ids=blocked,
                   grammar_bits=grammar_bits)


def prompt_targets(chunk: ScheduledChunk) -> list[int] | None:
    """Per position of the chunk, the next prompt token (-1 past the prompt); None unless the request asked for
    prompt logprobs and the chunk holds a position before the prompt's last token."""
    request = chunk.request
    if request.params.prompt_logprobs is None or chunk.start >= request.num_prompt_tokens - 1:
        return None
    following = [chunk.start + offset + 1 for offset in range(chunk.num_tokens)]
    return [request.prompt_token_ids[n] if n < request.num_prompt_tokens else -1 for n in following]


def encoder_buffer_layout(encoder_cache: EncoderCache | None) -> EncoderBufferLayout | None:
    """The encoder buffer the cache maps, as the worker sizes it: its rows, and the reserved block's."""
    return None if encoder_cache is None else EncoderBufferLayout(encoder_cache.num_rows, encoder_cache.block_rows)


def encode_items(items: Iterable[MultiModalItem], encoder_cache: EncoderCache) -> tuple[EncodeItem, ...]:
    """Images to encode (rows already given by `encoder_cache`) as the worker takes them: input and rows."""
    return tuple(EncodeItem(item.hash, np.asarray(encoder_cache.item_rows(item.hash), np.int32),
                            np.asarray(item.data, np.float32), item.grid) for item in items)


def plan_chunks(chunks: list[ScheduledChunk], encoder_cache: EncoderCache | None = None,
                mrope: bool = False) -> list[ChunkPlan]:
    return [ChunkPlan(chunk.request.request_id, chunk_row(chunk, encoder_cache, mrope), row_spec(chunk),
                      chunk.samples, chunk.request.params.logprobs is not None, chunk.request.grammar is not None,
                      prompt_targets(chunk), encode_items(chunk.encode, encoder_cache) if chunk.encode else (),
                      chunk.draft_ids,
                      tuple(row_spec(chunk, i) for i in range(1, len(chunk.draft_ids) + 1)) if chunk.draft_ids else (),
                      chunk.page_copy)
            for chunk in chunks]


@dataclasses.dataclass
class StepInFlight:
    """A dispatched step: the scheduler's chunks and the worker's device calls for them (one or two groups)."""

    chunks: list[ScheduledChunk]
    groups: list[DispatchedGroup]

    @classmethod
    def dispatch(cls, runner: ModelRunner, chunks: list[ScheduledChunk], encoder_cache: EncoderCache | None,
                 source: StepInFlight | None = None, gate: Callable[[], bool] | None = None) -> StepInFlight | None:
        """Plan `chunks` and start their device steps (look-ahead chunks of `source`'s requests when given);
        None if `gate` (asked once the look-ahead step is prepared, before it starts) says no."""
        plans = plan_chunks(chunks, encoder_cache, runner.mrope)
        groups = runner.dispatch(plans, source=None if source is None else source.groups[0], gate=gate)
        return None if groups is None else cls(chunks, groups)

    @functools.cached_property
    def step_order(self) -> list[ScheduledChunk]:
        """The chunks in the order of the groups' rows."""
        by_id = {chunk.request.request_id: chunk for chunk in self.chunks}
        return [by_id[plan.request_id] for group in self.groups for plan in group.plans]

    def grammar_bits(self) -> list[np.ndarray | None]:
        """Per row of the (single) group: the allowed-token bits of its request's grammar now, None for a request
        without one or finished."""
        return [None if chunk.request.grammar is None or chunk.request.is_finished
                else chunk.request.grammar.allowed_bits() for chunk in self.step_order]
