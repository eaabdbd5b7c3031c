"""Continuous-batching scheduler: token budget, chunked prefill, FCFS or priority admission, preemption by recompute."""
from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from typing import Any, Literal

from jvllm.core.encoder_cache import EncoderBudget, EncoderCache, MultiModalItem
from jvllm.core.kv_pages import OutOfPages, PageManager
from jvllm.core.prefix_cache import has_images_in, request_page_keys, tail_owner
from jvllm.core.request import Request, RequestStatus

SchedulingPolicy = Literal["fcfs", "priority"]


def check_priority(priority: int, policy: SchedulingPolicy) -> None:
    """A request's priority must be an integer, and other than 0 only under the priority policy (as vLLM's)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"got priority {priority}, but the engine schedules first come, first served; start it "
                         "with scheduling_policy='priority' (--scheduling-policy priority) to use priorities")


def priority_order(request: Request) -> tuple[int, float]:
    """The priority policy's order, as vLLM's: a lower `priority` value first, then earlier arrival."""
    return request.priority, request.arrival_time


@dataclasses.dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its `num_computed_tokens`, run this step. A `lookahead`
    chunk computes the token the previous step is still sampling on the device (see jvllm.core.lookahead). A chunk
    with a `draft` (speculative decoding, a jvllm.spec_decode.drafter.DraftTokens) ends in its proposed tokens: a
    token is sampled after the last known token and after each draft, and the drafts are kept while they match."""

    request: Request
    num_tokens: int
    lookahead: bool = False
    draft: Any = None
    # a request starting from a cached tail: (that page, the request's copy of it), copied before the step
    page_copy: tuple[int, int] | None = None
    start: int = dataclasses.field(init=False)  # fixed at scheduling time, before commit() moves the request on
    samples: bool = dataclasses.field(init=False)  # reaches the last known token, so its logits are sampled
    # images whose encoder output this chunk needs and nobody has computed: encoded before the step runs
    encode: list[MultiModalItem] = dataclasses.field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.samples = self.lookahead or self.start + self.num_tokens - len(self.draft_ids) == self.request.num_tokens

    @property
    def pending_tokens(self) -> int:
        """Tokens of the request sampled on the device but not yet known on the host (0 or 1)."""
        return 1 if self.lookahead else 0

    @property
    def draft_ids(self) -> tuple[int, ...]:
        return () if self.draft is None else self.draft.token_ids


class Scheduler:
    """Decides each step which requests run and how many tokens each computes. Pure Python."""

    def __init__(self, pages: PageManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = False, encoder_cache: EncoderCache | None = None,
                 max_num_encoder_tokens: int = 0, policy: SchedulingPolicy = "fcfs",
                 drafter: Any = None):
        """`encoder_cache` (multimodal models): a chunk runs only once the images it touches have encoder rows,
        and a step encodes at most `max_num_encoder_tokens` rows of new images. `policy`: "fcfs" admits in
        arrival order; "priority" keeps the waiting queue and the running list in `priority_order`, so the
        preempted are always the lowest-priority requests, and a waiting request preempts running requests
        of lower priority when there is no room for it. `drafter` (speculative decoding, a
        jvllm.spec_decode.drafter.Drafter): decoding requests of small batches get its draft tokens to verify."""
        self.pages = pages
        self.drafter = drafter
        self.encoder_cache = encoder_cache
        self.max_num_encoder_tokens = max_num_encoder_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # under the priority policy, in priority_order
        self.num_preemptions = 0

    def max_kv_tokens(self) -> int:
        return self.pages.num_usable_pages * self.pages.page_size

    def check_fits(self, request: Request) -> None:
        """A request whose KV could never fit the whole pool is rejected up front, not left to hang."""
        needed = request.num_prompt_tokens + request.max_output_tokens - 1  # the last token's KV is never written
        if needed > self.max_kv_tokens():
            raise ValueError(
                f"request {request.request_id} needs KV space for {needed} tokens (prompt "
                f"{request.num_prompt_tokens} + max_tokens {request.max_output_tokens}) but the KV pool holds "
                f"{self.max_kv_tokens()} tokens; lower max_tokens or raise kv_cache_memory_bytes"
            )

    def add(self, request: Request) -> None:
        self.check_fits(request)
        if self.policy == "priority":
            bisect.insort_right(self.waiting, request, key=priority_order)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: running requests first (preempting from the back when pages run out), then
        waiting ones in queue order while the token budget, the sequence limit and free pages allow."""
        victims = self._make_room_for_higher_priority() if self.policy == "priority" else []
        budget = self.max_num_batched_tokens
        encoder = None if self.encoder_cache is None else EncoderBudget(self.max_num_encoder_tokens)
        chunks: list[ScheduledChunk] = []
        preempted = False
        index = 0
        speculates = self.drafter is not None and self.drafter.speculates(len(self.running))
        drafted = 0  # draft tokens scheduled: each takes a sampler row of the step's max_num_seqs
        # the rows (decoding rows and drafts) the step's drafts may bring it to, shared out among decoding requests
        draft_rows = min(self.max_num_seqs, self.drafter.max_step_rows) if speculates else 0
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1] if speculates else []
        if speculates:  # a draft model drafts for every decoding request at once
            self.drafter.prepare(decoding)
        undrafted = len(decoding)  # decoding requests not yet offered drafts
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            wanted = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = None
            if speculates and request.num_tokens - request.num_computed_tokens == 1:
                share = (draft_rows - len(self.running) - drafted) // undrafted  # what earlier ones left over
                undrafted -= 1
                draft = self.drafter.propose(request, min(budget - 1, share))
                wanted += 0 if draft is None else len(draft.token_ids)
            count = self._encoder_room(request, wanted, encoder)
            if count == 0 < wanted:  # its next image waits for encoder rows or budget
                index += 1
                continue
            reserved, evicted = self._reserve_pages(request, count)
            preempted |= evicted
            if not reserved:
                if encoder is not None:
                    encoder.drop(request.request_id)
                break  # `request` itself was preempted; it was the last one running
            chunks.append(self._chunk(request, count, encoder, draft))
            drafted += len(chunks[-1].draft_ids)
            budget -= count
            index += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) + drafted < self.max_num_seqs:
            request = self.waiting[0]
            if any(request is victim for victim in victims):
                break  # preempted for a higher rank this step: it waits at least one step
            if not self._fork_prompt_pages(request):
                break  # its sibling is still computing the shared prompt: wait one step, in FCFS order
            cached_pages = self._lookup_prefix(request)
            count = self._encoder_room(request, min(request.num_tokens - request.num_computed_tokens, budget), encoder)
            needed = self.pages.pages_for_tokens(request.num_computed_tokens + count) - len(request.page_table)
            if count == 0 or needed > self.pages.num_free_pages:
                self._undo_lookup(request, cached_pages)
                self._undo_encoder(request, encoder)
                break  # strict queue order: later requests do not overtake the head of the queue
            if cached_pages is not None:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += request.num_cached_tokens
            self.waiting.popleft()
            request.page_table += self.pages.allocate(needed)
            request.set_status(RequestStatus.RUNNING)
            request.first_scheduled_time = request.first_scheduled_time or time.time()
            if self.policy == "priority":
                bisect.insort_right(self.running, request, key=priority_order)
            else:
                self.running.append(request)
            chunks.append(self._chunk(request, count, encoder))
            chunks[-1].page_copy, request.tail_copy = request.tail_copy, None
            budget -= count
        return chunks

    def _make_room_for_higher_priority(self) -> list[Request]:
        """Preempt the lowest-priority running requests while the head of the queue outranks them and lacks a
        sequence slot or the pages of its first chunk. -> the preempted."""
        victims: list[Request] = []
        while self.waiting and self.running and priority_order(self.waiting[0]) < priority_order(self.running[-1]):
            head = self.waiting[0]
            first_chunk = min(head.num_tokens - head.num_computed_tokens, self.max_num_batched_tokens)
            needed = self.pages.pages_for_tokens(head.num_computed_tokens + first_chunk) - len(head.page_table)
            if len(self.running) < self.max_num_seqs and needed <= self.pages.num_free_pages:
                break
            victims.append(self.running[-1])
            self._preempt(victims[-1])
        return victims

    def _encoder_room(self, request: Request, count: int, encoder: EncoderBudget | None) -> int:
        """How many of the next `count` tokens can run: all, unless an image among them cannot be encoded yet."""
        if encoder is None or not request.mm_items:
            return count
        return self.encoder_cache.schedule(request, request.num_computed_tokens, count, encoder)

    def _undo_encoder(self, request: Request, encoder: EncoderBudget | None) -> None:
        if encoder is not None:
            encoder.drop(request.request_id)
            self.encoder_cache.release(request)

    @staticmethod
    def _chunk(request: Request, count: int, encoder: EncoderBudget | None, draft: Any = None) -> ScheduledChunk:
        chunk = ScheduledChunk(request, count, draft=draft)
        if encoder is not None:
            chunk.encode = encoder.items_of(request.request_id)
        return chunk

    def _fork_prompt_pages(self, request: Request) -> bool:
        """An n > 1 member shares the full prompt pages its sibling already computed (read-only: both write
        only past them) and computes just the rest. -> False while the sibling's prompt is still in flight."""
        source = request.prompt_source
        if source is None or request.page_table or request.num_computed_tokens:
            return True
        shared = (request.num_prompt_tokens - 1) // self.pages.page_size  # keep >= 1 token to compute and sample
        if source.status is not RequestStatus.RUNNING:
            return True  # the sibling finished or was preempted: compute the prompt alone
        if source.num_computed_tokens < shared * self.pages.page_size:
            return False
        pages = source.page_table[:shared]
        self.pages.share(pages)
        request.page_table = list(pages)
        request.num_computed_tokens = request.num_cached_tokens = shared * self.pages.page_size
        request.num_registered_pages = min(source.num_registered_pages, shared)
        return True

    def _lookup_prefix(self, request: Request) -> list[int] | None:
        """Start a fresh request on the cached pages of its longest cached prefix -> those pages (None: no
        lookup made). The last token is always computed, so there are logits to sample from; requests that
        want prompt logprobs compute their whole prompt."""
        if not self.enable_prefix_caching or request.page_table or request.params.prompt_logprobs is not None:
            return None
        keys = request_page_keys(request, (request.num_tokens - 1) // self.pages.page_size, self.pages.page_size)
        cached = self.pages.lookup(keys)
        request.page_table = list(cached)
        request.num_computed_tokens = request.num_cached_tokens = len(cached) * self.pages.page_size
        request.num_registered_pages = len(cached)
        self._continue_from_tail(request)
        return cached

    def _continue_from_tail(self, request: Request) -> None:
        """After its cached full pages, a fresh request takes a copy of the cached tail that shares the most of its
        next tokens (the last token is always computed); the copy is made on the device before its first step."""
        page_size = self.pages.page_size
        full = len(request.page_table)
        start = full * page_size
        room = min(page_size - 1, request.num_tokens - 1 - start)
        if room <= 0 or has_images_in(request, start, page_size):
            return
        match = self.pages.tail_match(tail_owner(request, full, page_size),
                                      request.tokens_between(start, start + room))
        if match is None:
            return
        source, shared = match
        self.pages.hold(source)  # not evicted to make room for its own copy
        try:
            copy = self.pages.allocate(1)[0]
        except OutOfPages:
            return
        finally:
            self.pages.release([source])
        request.page_table.append(copy)
        request.num_computed_tokens += shared
        request.num_cached_tokens += shared
        request.tail_copy = (source, copy)

    def _undo_lookup(self, request: Request, cached_pages: list[int] | None) -> None:
        if cached_pages is not None:
            self.pages.release(request.page_table)
            request.page_table, request.num_computed_tokens, request.num_registered_pages = [], 0, 0
            request.num_cached_tokens, request.tail_copy = 0, None

    def _keep_tail(self, request: Request) -> None:
        """As a request leaves the pool, offer its partly filled last page to the prefix cache."""
        page_size = self.pages.page_size
        computed = min(request.num_computed_tokens, request.num_tokens)  # KV written for known tokens only
        full, used = divmod(computed, page_size)
        if not self.enable_prefix_caching or used == 0 or len(request.page_table) <= full:
            return
        start = full * page_size
        if has_images_in(request, start, page_size):
            return
        self.pages.register_tail(request.page_table[full], tail_owner(request, full, page_size),
                                 tuple(request.tokens_between(start, computed)))

    def _register_full_pages(self, request: Request) -> None:
        """Offer the request's newly full, computed pages to the prefix cache."""
        full = request.num_computed_tokens // self.pages.page_size
        if full <= request.num_registered_pages:
            return
        keys = request_page_keys(request, full, self.pages.page_size)
        for index in range(request.num_registered_pages, full):
            self.pages.register(request.page_table[index], keys[index])
        request.num_registered_pages = full

    def reset_prefix_cache(self) -> None:
        self.pages.reset_prefix_cache()

    def _reserve_pages(self, request: Request, count: int) -> tuple[bool, bool]:
        """Give `request` pages for `count` more tokens, preempting from the back of the running list.
        -> (whether `request` got them, whether anything was preempted)."""
        needed = self.pages.pages_for_tokens(request.num_computed_tokens + count) - len(request.page_table)
        preempted = False
        while needed > self.pages.num_free_pages:
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is request:
                return False, True
        request.page_table += self.pages.allocate(max(needed, 0))
        return True, preempted

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV; it rejoins the queue (its front, or its place in priority order) and recomputes
        its tokens later."""
        self.running.remove(request)
        self._keep_tail(request)
        self.pages.release(request.page_table)
        request.page_table = []
        request.num_computed_tokens = request.num_registered_pages = 0
        if self.encoder_cache is not None:
            self.encoder_cache.release(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.set_status(RequestStatus.PREEMPTED)
        request.set_status(RequestStatus.WAITING)
        if self.policy == "priority":
            bisect.insort_left(self.waiting, request, key=priority_order)
        else:
            self.waiting.appendleft(request)

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """Once the step is dispatched: the scheduled tokens have (or will have, in device order) KV in the pool."""
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens - len(chunk.draft_ids)  # drafts: accept_drafts
            if self.enable_prefix_caching:
                self._register_full_pages(chunk.request)
            if self.encoder_cache is not None:
                self.encoder_cache.mark_ready(chunk.encode)
                self.encoder_cache.release_passed(chunk.request)

    def accept_drafts(self, request: Request, accepted: int) -> None:
        """After a verification step whose first `accepted` drafts were kept (and the tokens sampled after them
        appended): their KV is valid; the pages past the request's next token, which only rejected drafts used, go
        back to the pool."""
        request.num_computed_tokens += accepted
        if self.enable_prefix_caching:
            self._register_full_pages(request)
        keep = self.pages.pages_for_tokens(request.num_tokens)
        if len(request.page_table) > keep:
            self.pages.release(request.page_table[keep:])
            del request.page_table[keep:]

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a running or waiting request, returning its pages."""
        if not request.can_transition(status):  # check first, so a refused finish leaves the request queued
            raise RuntimeError(f"request {request.request_id}: illegal transition {request.status.name} -> "
                               f"{status.name}")
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._keep_tail(request)
        self.pages.release(request.page_table)
        request.page_table = []
        if self.encoder_cache is not None:
            self.encoder_cache.release(request)
        request.set_status(status)
