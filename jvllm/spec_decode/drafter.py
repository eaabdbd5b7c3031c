"""The engine's speculation: when a request speculates, its draft tokens (checked against its grammar), and what
was accepted (counters per engine and per request)."""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jvllm.core.request import Request
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.ngram import propose_ngram
from jvllm.spec_decode.suffix import OutputCache, propose_suffix

MAX_BACKOFF_TOKENS = 16  # a request whose drafts keep failing speculates at least once every this many tokens
# A request keeps speculating while its recent verification steps accepted at least this many drafts on average
# (on the 2-core CPU a 4-row verification step costs ~1.6 one-row decode steps; thresholds of 0.5 and 1.5 measured
# alike on the benchmark's prompts: docs/design/speculative_decoding.md).
MIN_MEAN_ACCEPTED = 1.5
# Unless batch-invariant (then within Engine.invariant_step_rows), a step that verifies drafts holds at most this
# many token rows (one request's full verification if that is more), shared evenly by the requests decoding together:
# on the 2-core CPU a step's cost grows with its rows (32 rows ~4.7 one-row steps), and a 128-row step of four
# requests' long drafts mostly verifies rejected ones (docs/design/speculative_decoding.md).
SHARED_STEP_ROWS = 32


@dataclasses.dataclass(frozen=True)
class DraftTokens:
    """A request's proposed tokens for one step; with a grammar, the allowed-token bits ([W] int32) after each."""

    token_ids: tuple[int, ...]
    grammar_bits: tuple[np.ndarray | None, ...] | None = None


@dataclasses.dataclass
class SpecDecodeStats:
    """Cumulative counters, as vLLM's spec_decode metrics: verification steps with drafts, draft tokens proposed,
    draft tokens accepted, and accepted drafts by position (index i: drafts accepted at position i + 1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step emits on average: the accepted drafts plus the token sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DraftModel(Protocol):
    """A smaller model of the same vocabulary that continues sequences greedily (jvllm.engine.draft_model)."""

    def continuations(self, sequences: list[list[int]], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy next tokens of each sequence, in one batched run."""
        ...


@dataclasses.dataclass
class _RequestSpeculation:
    """One request's token buffer (its prompt and output as int32, grown as tokens come) and back-off state."""

    tokens: np.ndarray
    length: int = 0
    misses: int = 0  # verification steps in a row below MIN_MEAN_ACCEPTED (moving mean)
    # back-off: the request proposes again once it holds this many tokens. A token count, not a count of propose
    # calls, because async scheduling's look-ahead steps advance a request without asking the drafter.
    resume_at: int = 0
    mean_accepted: float = float("inf")  # moving mean of the drafts its verification steps accepted

    def sync(self, request: Request) -> int:
        total = request.num_tokens
        if total > len(self.tokens):
            grown = np.zeros(max(total, 2 * len(self.tokens)), np.int32)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        for index in range(self.length, total):
            self.tokens[index] = request.token_at(index)
        self.length = total
        return total


class Drafter:
    """Proposes each decoding request's draft tokens for the scheduler, and learns from what the step accepted."""

    def __init__(self, config: SpeculativeConfig, draft_model: DraftModel | None = None,
                 max_step_rows: int | None = None):
        """`max_step_rows`: the most token rows (decoding rows and drafts) a step that verifies drafts may hold (None:
        SHARED_STEP_ROWS, or num_speculative_tokens + 1 if more)."""
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError("a Drafter needs a draft model for method draft_model, and takes one only then")
        self.config = config
        self.stats = SpecDecodeStats()
        self.cache = OutputCache(config.suffix_decoding_max_cached_requests)
        self.draft_model = draft_model
        self.max_step_rows = max_step_rows or max(SHARED_STEP_ROWS, config.num_speculative_tokens + 1)
        self._requests: dict[str, _RequestSpeculation] = {}
        self._prepared: dict[str, list[int]] = {}  # draft_model: this step's continuations by request id

    def speculates(self, num_running: int) -> bool:
        """Whether a batch of `num_running` requests speculates at all (small batches only: see the config)."""
        return num_running <= self.config.max_batch_size

    def _state(self, request: Request) -> _RequestSpeculation:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestSpeculation(
                np.zeros(max(64, 2 * request.num_tokens), np.int32))
        return state

    def _room(self, request: Request) -> int:
        """Draft tokens `request` may take: num_speculative_tokens, within its output limit (the last token is never
        a draft); 0 when it backs off or cannot use drafts (images)."""
        if request.mm_items or request.num_tokens < self._state(request).resume_at:
            return 0
        room = request.max_output_tokens - len(request.output_token_ids) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def prepare(self, requests: list[Request]) -> None:
        """Before the scheduler asks for this step's drafts: a draft model continues every one of `requests` that may
        speculate, in one batched run. (The other methods look their drafts up per request, in `propose`.)"""
        self._prepared.clear()
        if self.draft_model is None:
            return
        wanted = [(request, room) for request in requests if (room := self._room(request)) > 0]
        if not wanted:
            return
        sequences = []
        for request, _ in wanted:
            tokens, total = self._synced(request)
            sequences.append(tokens[:total].tolist())
        continuations = self.draft_model.continuations(sequences, [room for _, room in wanted])
        for (request, _), drafts in zip(wanted, continuations):
            self._prepared[request.request_id] = drafts

    def propose(self, request: Request, limit: int) -> DraftTokens | None:
        """Up to `limit` (and num_speculative_tokens) draft tokens for `request`, whose tokens are all computed but
        its last; None when it backs off, has nothing to propose, or cannot use drafts (images)."""
        limit = min(limit, self._room(request))
        if limit < 1:
            return None
        if self.draft_model is not None:
            drafts = self._prepared.pop(request.request_id, [])[:limit]
        else:
            drafts = self._proposal(*self._synced(request), limit)
        if drafts and request.grammar is not None:
            return self._grammar_prefix(request, drafts)
        return DraftTokens(tuple(drafts)) if drafts else None

    def has_proposal(self, request: Request) -> bool:
        """Whether `request` would draft now (async scheduling dispatches ahead only when no request would). A draft
        model always has a continuation: it is asked unless the request backs off."""
        if self._room(request) < 1:
            return False
        if self.draft_model is not None:
            return True
        return bool(self._proposal(*self._synced(request), 1))

    def _synced(self, request: Request) -> tuple[np.ndarray, int]:
        """The request's token buffer brought up to date (grown, if it had to be, into a new array) and its length."""
        state = self._state(request)
        total = state.sync(request)
        return state.tokens, total

    def _proposal(self, tokens: np.ndarray, num_tokens: int, limit: int) -> list[int]:
        config = self.config
        if config.method == "ngram":
            return propose_ngram(tokens, num_tokens, config.prompt_lookup_min, config.prompt_lookup_max, limit)
        return propose_suffix(tokens, num_tokens, self.cache, limit, config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)

    @staticmethod
    def _grammar_prefix(request: Request, drafts: list[int]) -> DraftTokens | None:
        """The drafts up to the first one the request's grammar does not allow, with the grammar's bits after each."""
        grammar = request.grammar.copy()
        kept: list[int] = []
        after: list[np.ndarray | None] = []
        bits = grammar.allowed_bits()
        for token in drafts:
            if bits is not None and not (int(bits[token >> 5]) >> (token & 31)) & 1:
                break
            if not grammar.accept(token) or grammar.error is not None:
                break
            bits = grammar.allowed_bits()
            kept.append(token)
            after.append(None if bits is None else bits.copy())
        return DraftTokens(tuple(kept), tuple(after)) if kept else None

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        """After a verification step of `drafted` drafts, `accepted` of them kept: counters and back-off (a request
        whose recent drafts are mostly rejected waits 1, 2, 4, ... up to MAX_BACKOFF_TOKENS tokens between proposals,
        and its next good step resets the wait)."""
        self.stats.record(drafted, accepted)
        request.num_draft_tokens += drafted
        request.num_accepted_tokens += accepted
        state = self._state(request)
        state.mean_accepted = accepted if state.mean_accepted == float("inf") else (state.mean_accepted + accepted) / 2
        if state.mean_accepted >= MIN_MEAN_ACCEPTED:
            state.misses = 0
        else:
            state.misses += 1
            state.resume_at = request.num_tokens + min(2 ** (state.misses - 1), MAX_BACKOFF_TOKENS)

    def finish(self, request: Request) -> None:
        """Forget the request; its output joins the suffix cache."""
        self._requests.pop(request.request_id, None)
        if self.config.method == "suffix":
            self.cache.add(request.output_token_ids)
