"""A request's state: tokens, pages, progress and its status state machine."""
from __future__ import annotations

import enum
import time
from typing import Any

from jvllm.core.bad_words import BadWordIds
from jvllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # the request could not go on (Request.error says why)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_ENDS = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
         RequestStatus.FINISHED_ERROR}
_ALLOWED: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED, *_ENDS},
    RequestStatus.PREEMPTED: {RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED},
}


class Request:
    """One sequence being generated. Pages hold the KV of its first `num_computed_tokens` tokens."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, max_total_tokens: int, eos_token_ids: tuple[int, ...] = (),
                 arrival_time: float | None = None, priority: int = 0):
        self.request_id = request_id
        self.group_id = request_id  # the user's id; differs for the n > 1 members of one prompt
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # every request has one, so sampling is keyed by (seed, position) alone
        self.max_total_tokens = max_total_tokens  # prompt + output never exceeds this (max_model_len)
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.bad_word_ids: BadWordIds = ()  # params.bad_words as token sequences (core.bad_words)
        # summed only when logprobs are asked for, as in vLLM: otherwise None and no step computes them
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.logprobs: list[dict] = []  # one {token_id: Logprob} per output token when params.logprobs is set
        # filled as prompt chunks run, if asked; the first prompt token has nothing before it
        self.prompt_logprobs: list[dict | None] | None = None if params.prompt_logprobs is None else [None]
        self.status = RequestStatus.WAITING
        self.page_table: list[int] = []
        self.num_computed_tokens = 0
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority  # the priority policy runs lower values first
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.detokenizer: Any = None  # attached by the engine
        self.prompt_source: Request | None = None  # an n > 1 sibling whose computed prompt pages this one shares
        self.num_cached_tokens = 0  # prompt tokens whose KV came from shared or cached pages, not computed
        self.cache_salt: str | None = None  # isolates this request's prefix-cache entries from others'
        self.page_keys: list[int] = []  # prefix-cache keys of its full pages, computed as needed
        self.num_registered_pages = 0  # leading pages already offered to the prefix cache
        self.tail_copy: tuple[int, int] | None = None  # (cached tail page, its copy) to copy at its first chunk
        self.grammar: Any = None  # structured outputs: a jvllm.structured GrammarState fed every output token
        self.mm_items: list = []  # multimodal: jvllm.core.encoder_cache.MultiModalItem per image, by offset
        self.num_draft_tokens = 0  # speculative decoding: draft tokens verified for this request
        self.num_accepted_tokens = 0  # of those, accepted

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_output_tokens(self) -> int:
        room = self.max_total_tokens - self.num_prompt_tokens
        return room if self.params.max_tokens is None else min(self.params.max_tokens, room)

    def token_at(self, index: int) -> int:
        n = self.num_prompt_tokens
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """The ids at positions start..end-1 (prompt, then output)."""
        n = self.num_prompt_tokens
        if end <= n:
            return list(self.prompt_token_ids[start:end])
        if start >= n:
            return list(self.output_token_ids[start - n : end - n])
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - n]]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def can_transition(self, new: RequestStatus) -> bool:
        return new in _ALLOWED.get(self.status, set())

    def set_status(self, new: RequestStatus) -> None:
        if not self.can_transition(new):
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new
        if new.is_finished:
            self.finished_time = time.time()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, pages={len(self.page_table)})")
