"""What AsyncEngine reports about itself: the errors its callers see and the stats snapshot it publishes."""
from __future__ import annotations

import dataclasses


class EngineDeadError(RuntimeError):
    """The engine thread stopped (fatal error or shutdown); no request can be served any more."""


class EngineShutDownError(EngineDeadError):
    """The engine was shut down on purpose (server stop) while the request was queued or running."""


class EngineStepError(RuntimeError):
    """A model step failed while this request was running; the request was aborted."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; retry later."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the engine thread after every step (safe to read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV pages in use
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative, of those, tokens found there
    num_steps: int = 0  # cumulative
    # speculative decoding (cumulative): verification steps with drafts, draft tokens, accepted draft tokens, and
    # accepted drafts by position (None: the engine does not speculate)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] | None = None


__all__ = ["EngineDeadError", "EngineShutDownError", "EngineStats", "EngineStepError", "QueueFullError"]
