"""Requests with `use_beam_search` (vLLM's extension of completions and chat): n is the beam width, and the search's
one final output takes the place of the request's stream."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jvllm.beam_search import BeamSearchParams
from jvllm.engine.async_beam_search import start_beam_search
from jvllm.engine.request_stream import RequestStream
from jvllm.sampling_params import SamplingParams
from server.api_errors import bad_request
from server.protocol import SamplingFields

if TYPE_CHECKING:
    from server.state import ServerState


def beam_search_params(body: SamplingFields, params: SamplingParams) -> BeamSearchParams | None:
    """The search a use_beam_search request asks for (None without it); 400 for what a beam search cannot honour.
    Sampling options other than temperature do not apply to it, as in vLLM."""
    if not body.use_beam_search:
        return None
    refused = {"structured outputs or a response_format": params.structured_outputs is not None,
               "stop or stop_token_ids": bool(params.stop or params.stop_token_ids),
               "prompt_logprobs (or echo with logprobs)": params.prompt_logprobs is not None}
    for what, given in refused.items():
        if given:
            raise bad_request(f"use_beam_search does not take {what}", "use_beam_search")
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=0.0 if body.temperature is None else body.temperature,
                                length_penalty=body.length_penalty)
    except ValueError as error:
        message = str(error)
        if message.startswith("beam_width"):
            raise bad_request("with use_beam_search, n is the beam width: " + message, "n") from None
        raise bad_request(message, message.split(" ", 1)[0]) from None


async def queue_generation(state: ServerState, prompt: dict[str, Any], params: SamplingParams,
                           beam: BeamSearchParams | None, request_id: str, *, arrival_time: float,
                           priority: int) -> RequestStream:
    """The request queued on the engine, or with `beam` its beam search started: -> its output stream."""
    if beam is None:
        return await state.engine.add_request(prompt, params, request_id, arrival_time=arrival_time,
                                              priority=priority)
    if prompt.get("multi_modal_data"):
        raise bad_request("use_beam_search does not take images", "use_beam_search")
    return start_beam_search(state.engine, prompt.get("prompt"), prompt["prompt_token_ids"], beam, request_id,
                             logprobs=params.logprobs, priority=priority)
