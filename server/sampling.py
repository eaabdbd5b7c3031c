"""Request checks shared by the routes: model name, context length, and the SamplingParams to run."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from jvllm.engine.prompts import keep_last
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams, StructuredOutputsParams
from server.api_errors import APIError, bad_request
from server.limits import AdmissionLimits
from server.protocol import RequestBody, SamplingFields
from server.responses import PromptTokensDetails
from server.settings import ServerSettings

if TYPE_CHECKING:
    from server.state import ServerState

logger = logging.getLogger("jvllm.server")


def check_model(requested: str | None, settings: ServerSettings) -> str:
    """-> the name to report; unknown names are 404 as in OpenAI (None means the default model)."""
    if requested is None or requested in settings.served_model_names:
        return settings.model_name
    raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


def check_generates(model: str, state: ServerState) -> None:
    """Generation routes on an embedding model: 400 saying what it can do instead."""
    if not state.engine.supports_generation:
        if state.engine.is_cross_encoder:
            raise bad_request(f"{model} is a cross-encoder: it cannot generate text; use /v1/score or /v1/rerank",
                              "model")
        raise bad_request(f"{model} is an embedding model: it cannot generate text; use /v1/embeddings", "model")


def warn_unknown_fields(body: RequestBody, route: str) -> None:
    extra = sorted(body.model_extra or {})
    if extra:
        logger.warning("%s: ignored unknown request fields %s", route, extra)


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """-> max_tokens to run (None fills the context); 400 with both numbers when it cannot fit."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                          f"has {num_prompt_tokens} tokens, which leaves no room for a completion. Please "
                          "shorten the prompt.", "prompt")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                          "in the completion). Please reduce the length of the prompt or max_tokens.", "max_tokens")
    return max_tokens


def truncated(token_ids: list[int], body: SamplingFields, max_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's ids as truncate_prompt_tokens keeps them (-1: as many as leave room for max_tokens)."""
    k = body.truncate_prompt_tokens
    if k is not None and k != -1 and k < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or an int >= 1, got {k}", "truncate_prompt_tokens")
    return keep_last(token_ids, k, max(1, max_model_len - (max_tokens or 1)))


def check_unsupported(body: SamplingFields, limits: AdmissionLimits) -> None:
    limits.check_n(body.n, body.best_of)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of ({body.best_of}) other than n ({body.n}) is not supported", "best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def cached_details(state: ServerState, outputs: list[RequestOutput],
                   always: bool = False) -> PromptTokensDetails | None:
    """usage.prompt_tokens_details with --enable-prompt-tokens-details (or `always`: APIs whose usage always
    reports cache reads): the prompt tokens the prefix cache gave."""
    if not (always or state.settings.enable_prompt_tokens_details):
        return None
    return PromptTokensDetails(cached_tokens=sum(output.num_cached_tokens or 0 for output in outputs))


def check_logprobs(count: int | None, settings: ServerSettings, param: str) -> None:
    if count is not None and not (0 <= count <= settings.max_logprobs):
        raise bad_request(f"{param} must be between 0 and {settings.max_logprobs} (the server's --max-logprobs), "
                          f"got {count}", param)


def sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None,
                    defaults: dict[str, Any] | None = None) -> SamplingParams:
    """What the request leaves out comes from `defaults` (the model's generation config, as vLLM's server takes
    it), else OpenAI's defaults; SamplingParams' ValueError becomes a 400."""
    defaults = defaults or {}

    def given(value, name: str, default):
        return defaults.get(name, default) if value is None else value

    try:
        return SamplingParams(
            n=body.n, temperature=given(body.temperature, "temperature", 1.0),
            top_p=given(body.top_p, "top_p", 1.0), top_k=given(body.top_k, "top_k", 0),
            min_p=given(body.min_p, "min_p", 0.0), presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=given(body.repetition_penalty, "repetition_penalty", 1.0), seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, max_tokens=max_tokens,
            min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, logit_bias=body.logit_bias,
            allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words, structured_outputs=structured_outputs)
    except ValueError as error:  # SamplingParams' messages start with the field's name
        field = str(error).split(" ", 1)[0]
        raise bad_request(str(error), field if field in SamplingParams.__dataclass_fields__ else None) from None


def tokens_as_ids(requested: bool | None, settings: ServerSettings) -> bool:
    """Whether logprobs name tokens as "token_id:N": the request's return_tokens_as_token_ids, else the server's
    --return-tokens-as-token-ids."""
    return settings.return_tokens_as_token_ids if requested is None else requested
