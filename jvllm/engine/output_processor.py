"""After each step: append sampled tokens (and verified drafts), detokenize, apply stop rules, build RequestOutputs."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from jvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jvllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from jvllm.core.scheduler import ScheduledChunk, Scheduler
    from jvllm.spec_decode.drafter import Drafter
    from jvllm.worker.step_results import StepResult


def record_prompt_logprobs(request: Request, result: StepResult, decode: Callable[[int], str]) -> None:
    """Append a chunk's prompt logprobs; positions already recorded (a preempted request recomputing its prompt)
    are skipped, so each prompt token has exactly one entry."""
    k = request.params.prompt_logprobs
    if k is None or request.prompt_logprobs is None or not result.prompt_logprobs:
        return
    for index, stats in enumerate(result.prompt_logprobs, start=result.prompt_start):
        if index == len(request.prompt_logprobs):
            request.prompt_logprobs.append(stats.as_dict(request.prompt_token_ids[index], k, decode))


def append_token(request: Request, result: StepResult, decode: Callable[[int], str]) -> RequestStatus | None:
    """Record one sampled token; -> the finished status it causes, or None if the request goes on."""
    now = time.time()
    token_id = result.token_id
    request.output_token_ids.append(token_id)
    if request.grammar is not None:
        request.grammar.accept(token_id)
        if request.grammar.error is not None:  # a parser limit met while masking: the output breaks its constraint
            request.error = f"the output cannot follow its structured-output constraint: {request.grammar.error}"
            return RequestStatus.FINISHED_ERROR
    if request.params.logprobs is not None and result.token_logprobs is not None:
        request.cumulative_logprob += result.token_logprobs.logprob
        request.logprobs.append(result.token_logprobs.as_dict(token_id, request.params.logprobs, decode))
    request.first_token_time = request.first_token_time or now
    request.last_token_time = now
    params = request.params
    num_out = len(request.output_token_ids)
    may_stop = num_out >= params.min_tokens
    if may_stop and not params.ignore_eos and token_id in request.eos_token_ids:
        request.stop_reason = None  # vLLM reports None for EOS
        return RequestStatus.FINISHED_STOPPED
    if may_stop and token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    stop_string = request.detokenizer.add_tokens([token_id]) if request.detokenizer else None
    if stop_string is not None and may_stop:
        request.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    if num_out >= request.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_sampled(chunk: ScheduledChunk, result: StepResult, decode: Callable[[int], str], scheduler: Scheduler,
                   drafter: Drafter | None) -> RequestStatus | None:
    """Append the chunk's sampled token; after draft tokens, also each token sampled after a draft while the drafts
    match what was sampled (the tokens plain decoding would have given), then settle the drafts' pages.
    -> the finish it causes."""
    request, drafts = chunk.request, chunk.draft_ids
    accepted = 0
    for index, sampled in enumerate([result, *result.after_drafts]):
        status = append_token(request, sampled, decode)
        if status is not None or index == len(drafts) or sampled.token_id != drafts[index]:
            break
        accepted += 1
    if drafts:
        drafter.record(request, len(drafts), accepted)
        if status is None:
            scheduler.accept_drafts(request, accepted)
    return status


def completion_output(request: Request, index: int) -> CompletionOutput:
    finished = request.is_finished
    text = request.detokenizer.emittable_text(finished) if request.detokenizer else ""
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(request.output_token_ids),
        cumulative_logprob=request.cumulative_logprob,
        logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        error=request.error,
    )


def request_output(request_id: str, members: list[Request]) -> RequestOutput:
    """One RequestOutput for a prompt's n completions."""
    first = members[0]
    finished = all(m.is_finished for m in members)
    metrics = RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min((m.first_token_time for m in members if m.first_token_time), default=None),
        last_token_time=max((m.last_token_time for m in members if m.last_token_time), default=None),
        finished_time=max((m.finished_time or 0.0) for m in members) if finished else None,
        num_draft_tokens=sum(m.num_draft_tokens for m in members),
        num_accepted_tokens=sum(m.num_accepted_tokens for m in members),
    )
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=list(first.prompt_token_ids),
        prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
        outputs=[completion_output(m, i) for i, m in enumerate(members)],
        finished=finished,
        metrics=metrics,
        num_cached_tokens=max(m.num_cached_tokens for m in members),
    )
