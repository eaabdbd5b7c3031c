"""Async scheduling: plan the next decode step while the current step's sampled ids are still on the device.

The next step's input token for each request is the token the current step is sampling, so the host does not
wait for it: the runner feeds it from the device array (ModelRunner.dispatch with `source`). Meanwhile the host
reads, detokenizes and stop-checks the current step, so its work overlaps the device's instead of following it.
A request that the current step finishes (EOS, a stop string) computed one token for nothing; its row is dropped.

Pure Python (no JAX), like the scheduler."""
from __future__ import annotations

from jvllm.core.bad_words import follows_output
from jvllm.core.request import Request
from jvllm.core.scheduler import ScheduledChunk, Scheduler


def _has_next_step(request: Request) -> bool:
    """False when the token being sampled now is the request's last (max_tokens or max_model_len)."""
    return len(request.output_token_ids) + 1 < request.max_output_tokens


def plan_lookahead(scheduler: Scheduler, current: list[ScheduledChunk]) -> list[ScheduledChunk] | None:
    """One-token chunks continuing `current` (a step just dispatched and committed, every chunk sampling), with
    pages reserved for the token each will compute; None when the next step must be scheduled normally: a
    request is waiting to be admitted, not every running request is in `current`, one uses penalties or verifies
    draft tokens, or pages are short. Never preempts. Requests whose current token is their last are left out: they finish now."""
    return reserve_lookahead(scheduler, current) if lookahead_possible(scheduler, current) else None


def lookahead_possible(scheduler: Scheduler, current: list[ScheduledChunk]) -> bool:
    """plan_lookahead's checks before it reserves pages: whether `current` may be followed by a look-ahead step
    at all (the engine asks this before asking its drafter anything)."""
    if scheduler.waiting or len(current) != len(scheduler.running):
        return False
    # Penalties count every output token, including the one still on the device. All or nothing: a request
    # left out of the look-ahead step would advance only every other step. (Grammars are fine: the look-ahead
    # step's sampler waits for them, see ModelRunner.finish_head.)
    if not all(chunk.samples and not chunk.request.params.uses_penalties for chunk in current):
        return False
    # Likewise bad words of two or more tokens: what they block next depends on the token still on the device.
    if any(follows_output(chunk.request.bad_word_ids) for chunk in current):
        return False
    # how many drafts a verification step keeps is known on the host only
    return all(chunk.draft is None for chunk in current)


def reserve_lookahead(scheduler: Scheduler, current: list[ScheduledChunk]) -> list[ScheduledChunk] | None:
    """The look-ahead chunks of `current` (lookahead_possible said yes) with their pages reserved; None when no
    request goes on or pages are short."""
    requests = [chunk.request for chunk in current if _has_next_step(chunk.request)]
    if not requests:
        return None
    pages = scheduler.pages
    # The token being sampled now sits at index num_computed_tokens (== num_tokens after the commit).
    needed = [pages.pages_for_tokens(r.num_computed_tokens + 1) - len(r.page_table) for r in requests]
    if sum(max(n, 0) for n in needed) > pages.num_free_pages:
        return None
    for request, count in zip(requests, needed):
        if count > 0:
            request.page_table += pages.allocate(count)
    return [ScheduledChunk(request, 1, lookahead=True) for request in requests]


def settle_lookahead(scheduler: Scheduler, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """After the previous step's tokens are on the host: commit the look-ahead chunks whose request goes on
    (its sampled token is now its last known token, the one this step computes); -> those chunks."""
    alive = [chunk for chunk in chunks if not chunk.request.is_finished]
    for chunk in alive:
        assert chunk.start == chunk.request.num_tokens - 1, "a look-ahead chunk computes the last known token"
    scheduler.commit(alive)
    return alive
