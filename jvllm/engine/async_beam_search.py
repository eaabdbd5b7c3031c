"""Beam search on the AsyncEngine (the server's `use_beam_search`): the rounds of jvllm.beam_search run as a task on
the caller's event loop, each live beam a one-token request; the result arrives as one final RequestOutput whose n
completions are the best beams."""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

from jvllm.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from jvllm.engine.request_stream import RequestStream
from jvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jvllm.sampling_params import SamplingParams


class _Engine(Protocol):
    """What the search needs of AsyncEngine."""

    eos_token_ids: list[int]
    max_model_len: int

    async def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None, *,
                          arrival_time: float | None = None, priority: int = 0) -> RequestStream: ...

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


def start_beam_search(engine: _Engine, prompt_text: str | None, prompt_token_ids: list[int],
                      params: BeamSearchParams, request_id: str, *, logprobs: int | None = None,
                      priority: int = 0) -> RequestStream:
    """A stream that yields the search's result once (or its error); closing it early stops the search and aborts
    the round's requests. `logprobs`: per generated token, the chosen token and that many of the candidates."""
    loop = asyncio.get_running_loop()
    prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_token_ids}
    task: asyncio.Task | None = None

    def stop(stream: RequestStream) -> None:
        if task is not None and not task.done():
            task.cancel()

    stream = RequestStream(request_id, prompt, loop, stop)

    async def run() -> None:
        search = BeamSearch(prompt_token_ids, params, engine.eos_token_ids, engine.max_model_len)
        round_params = params.round_params()
        try:
            number = 0
            while not search.done:
                search.advance(await _round(engine, search, round_params, f"{request_id}-beam{number}", priority))
                number += 1
            best = search.best()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a refused or failed round: the reader gets the error
            stream.put(error)
            return
        outputs = [_completion(i, beam, len(prompt_token_ids), engine, logprobs) for i, beam in enumerate(best)]
        stream.put(RequestOutput(request_id, prompt_text, list(prompt_token_ids), None, outputs, True))

    task = loop.create_task(run())
    return stream


async def _round(engine: _Engine, search: BeamSearch, params: SamplingParams, prefix: str,
                 priority: int) -> list[RequestOutput]:
    """Each live beam's one-token request, run together; their final outputs in beam order."""
    streams: list[RequestStream] = []
    try:
        for i, beam in enumerate(search.live):
            streams.append(await engine.add_request({"prompt_token_ids": beam.tokens}, params, f"{prefix}-{i}",
                                                    priority=priority))
        return list(await asyncio.gather(*(_final(stream) for stream in streams)))
    finally:
        for stream in streams:
            stream.close()


async def _final(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    if last is None or not last.finished or last.outputs[0].finish_reason in ("abort", "error"):
        raise RuntimeError(f"a beam's request {stream.request_id} did not finish")
    return last


def _completion(index: int, beam: BeamSearchSequence, prompt_len: int, engine: _Engine,
                logprobs: int | None) -> CompletionOutput:
    generated = beam.tokens[prompt_len:]
    steps = None
    if logprobs is not None:
        steps = [_top(step, token, logprobs) for step, token in zip(beam.logprobs, generated)]
    text = engine.detokenize(generated, skip_special_tokens=True)
    return CompletionOutput(index, text, generated, beam.cum_logprob, steps, beam.finish_reason, beam.stop_reason)


def _top(step: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    """The chosen token and the k most likely candidates of a position."""
    ranked = sorted(step.items(), key=lambda item: item[1].logprob, reverse=True)[:k]
    return {token: step[token], **{t: lp for t, lp in ranked if t != token}}
