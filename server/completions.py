"""POST /v1/completions: prompts (text or token ids) to text, streamed or whole, with echo and logprobs."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jvllm.engine.request_stream import RequestStream
from jvllm.outputs import CompletionOutput, RequestOutput
from server.api_errors import bad_request
from server.logprobs import completion_logprobs
from server.protocol import CompletionRequest
from server.responses import CompletionChoice, CompletionLogProbs, CompletionResponse, UsageInfo
from server.beam_search import beam_search_params, queue_generation
from server.sampling import (cached_details, check_fits, check_generates, check_logprobs, check_model,
                             check_unsupported, sampling_params, tokens_as_ids, truncated, warn_unknown_fields)
from server.state import ServerState
from server.structured import structured_outputs
from server.streaming import DONE, include_usage, merge, sse, sse_response, unless_disconnected


@dataclasses.dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


def _raw_prompts(body: CompletionRequest) -> list[str | list[int]]:
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    return raw  # type: ignore[return-value]


async def _prompts(raw: list[str | list[int]], body: CompletionRequest, state: ServerState) -> list[Prompt]:
    """Text prompts are length-checked, then tokenized off the event loop; token id prompts are taken as is."""
    for i, item in enumerate(raw):
        if isinstance(item, str):
            state.limits.check_chars(len(item), "prompt" if len(raw) == 1 else f"prompt.{i}")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            prompts.append(Prompt(item, await state.tokenize(item, add_special_tokens=body.add_special_tokens)))
        else:
            prompts.append(Prompt(None, list(item)))
        if not prompts[-1].token_ids:
            raise bad_request("a prompt must contain at least one token", "prompt")
    return prompts


class _Job:
    """One completions request in flight: its prompts, streams and how to render their outputs."""

    def __init__(self, body: CompletionRequest, state: ServerState, model: str, prompts: list[Prompt]):
        self.body, self.state, self.model, self.prompts = body, state, model, prompts
        # echo with max_tokens 0 (OpenAI's legacy API, vLLM, lm-eval's log-likelihoods): the prompt and its
        # logprobs only; the engine runs one token, which is not shown
        self.echo_only = echo_only(body)
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def prompt_text(self, i: int) -> str:
        prompt = self.prompts[i]
        if prompt.text is None:
            prompt.text = self.state.engine.detokenize(prompt.token_ids)
        return prompt.text

    def logprobs(self, ids: list[int], steps: list | None, offset: int) -> CompletionLogProbs | None:
        if self.body.logprobs is None or steps is None:
            return None
        return completion_logprobs(ids, steps, self.body.logprobs, self.state.names, offset,
                                   tokens_as_ids(self.body.return_tokens_as_token_ids, self.state.settings))

    def echo_part(self, i: int, output: RequestOutput) -> tuple[str, CompletionLogProbs | None]:
        """The prompt as it is echoed before the completion, with its logprobs when asked."""
        text = self.prompt_text(i)
        return text, self.logprobs(output.prompt_token_ids, output.prompt_logprobs, 0)

    def usage(self, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = 0 if self.echo_only else sum(len(o.token_ids) for r in finals.values() for o in r.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=cached_details(self.state, list(finals.values())))

    def choice(self, i: int, output: RequestOutput, out: CompletionOutput) -> CompletionChoice:
        if self.echo_only:
            out = _nothing_generated(out)
        text, logprobs = out.text, None
        if self.body.logprobs is not None and out.logprobs is not None:
            logprobs = self.logprobs(out.token_ids, out.logprobs, 0)
        if self.body.echo:
            prefix, prefix_logprobs = self.echo_part(i, output)
            text = prefix + text
            if logprobs is not None:
                logprobs = _join(prefix_logprobs, self.logprobs(out.token_ids, out.logprobs, len(prefix)))
        return CompletionChoice(index=i * self.body.n + out.index, text=text, logprobs=logprobs,
                                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                                prompt_logprobs=_prompt_logprobs(output) if self.body.prompt_logprobs else None)

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices = [self.choice(i, finals[i], out) for i in sorted(finals) for out in finals[i].outputs]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage(finals))

    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        chunk = CompletionResponse(id=self.id, object="text_completion", created=self.created, model=self.model,
                                   choices=choices)
        if usage is not None:
            chunk.usage = usage
        return sse(chunk)

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        body = self.body
        sent_chars: dict[int, int] = {}  # per choice: text characters sent (echo included)
        sent_text: dict[int, int] = {}  # per choice: completion characters sent
        sent_ids: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}
        ended: set[int] = set()  # choices whose finish_reason was sent (n > 1 siblings may go on)
        options = body.stream_options
        async for i, output in merge(streams):
            latest[i] = output
            for out in output.outputs:
                index = i * body.n + out.index
                if index in ended:
                    continue
                if self.echo_only:
                    out = _nothing_generated(out)
                done_text, start = sent_text.get(index, 0), sent_ids.get(index, 0)
                prefix, logprobs = ("", None)
                if body.echo and index not in sent_chars:
                    prefix, logprobs = self.echo_part(i, output)
                new_ids = out.token_ids[start:]
                if body.logprobs is not None and new_ids and out.logprobs is not None:
                    offset = sent_chars.get(index, 0) + len(prefix)
                    logprobs = _join(logprobs, self.logprobs(new_ids, out.logprobs[start:], offset))
                text = prefix + out.text[done_text:]
                if not text and out.finish_reason is None and logprobs is None:
                    continue  # nothing to show yet (text held back by a possible stop string)
                if logprobs is None and body.logprobs is not None:
                    # asked for: an (empty) object, never null; fields set explicitly for exclude_unset
                    logprobs = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
                sent_text[index], sent_ids[index] = len(out.text), len(out.token_ids)
                sent_chars[index] = sent_chars.get(index, 0) + len(text)
                if out.finish_reason is not None:
                    ended.add(index)
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                usage = self.usage(latest) if options and options.continuous_usage_stats else None
                yield self.chunk([choice], usage)
            if output.finished:
                self.state.log_request(f"{self.id}-{i}", "finished", output.outputs[0].text)
        if include_usage(options, self.state.settings.enable_force_include_usage):
            yield self.chunk([], self.usage(latest))
        yield DONE


def echo_only(body: CompletionRequest) -> bool:
    """Whether the request asks for its prompt echoed and nothing generated."""
    return body.echo and body.max_tokens == 0


def _nothing_generated(out: CompletionOutput) -> CompletionOutput:
    """`out` as an echo-only request shows it: no text or tokens, and "length" once its one token is made."""
    finish_reason = "length" if out.finish_reason in ("stop", "length") else out.finish_reason
    return dataclasses.replace(out, text="", token_ids=[], logprobs=None if out.logprobs is None else [],
                               finish_reason=finish_reason, stop_reason=None)


def _join(first: CompletionLogProbs | None, second: CompletionLogProbs | None) -> CompletionLogProbs | None:
    if first is None or second is None:
        return first or second
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def _prompt_logprobs(output: RequestOutput) -> list | None:
    if output.prompt_logprobs is None:
        return None
    return [None if step is None else {tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                       for tid, lp in step.items()} for step in output.prompt_logprobs]


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    arrival = time.time()
    warn_unknown_fields(body, "/v1/completions")
    model = check_model(body.model, state.settings)
    check_generates(model, state)
    check_unsupported(body, state.limits)
    raw = _raw_prompts(body)
    state.limits.check_sequences(len(raw), body.n)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    check_logprobs(body.logprobs, state.settings, "logprobs")
    check_logprobs(body.prompt_logprobs, state.settings, "prompt_logprobs")
    constraint = await structured_outputs(body, state)
    prompts = await _prompts(raw, body, state)
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    limit = state.engine.max_model_len
    max_tokens = 1 if echo_only(body) else body.max_tokens
    for prompt in prompts:
        kept = truncated(prompt.token_ids, body, max_tokens, limit)
        if len(kept) < len(prompt.token_ids):
            prompt.text, prompt.token_ids = None, kept
    params = [sampling_params(body, max_tokens=check_fits(len(p.token_ids), max_tokens, limit),
                              logprobs=body.logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=constraint,
                              defaults=state.engine.default_sampling)
              for p in prompts]
    beams = [beam_search_params(body, param) for param in params]
    job = _Job(body, state, model, prompts)
    streams: list[RequestStream] = []
    try:
        for i, (prompt, param, beam) in enumerate(zip(prompts, params, beams)):
            state.log_request(f"{job.id}-{i}", "received", prompt.text or prompt.token_ids, param)
            streams.append(await queue_generation(state, {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids},
                                                  param, beam, f"{job.id}-{i}", arrival_time=arrival,
                                                  priority=body.priority))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    if body.stream:
        return sse_response(job.events(streams), streams, keep_alive_s=state.settings.sse_keep_alive_interval)

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, output in merge(streams):
            finals[i] = output
        return finals

    try:
        finals = await unless_disconnected(request, collect())
    finally:
        for stream in streams:
            stream.close()
    for i, output in finals.items():
        state.log_request(f"{job.id}-{i}", "finished", output.outputs[0].text)
    return JSONResponse(job.response(finals).model_dump())
