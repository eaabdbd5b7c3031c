"""POST /v1/chat/completions: messages through the chat template, streamed (role first) or whole."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jvllm.engine.request_stream import RequestStream
from jvllm.outputs import CompletionOutput, RequestOutput
from server.api_errors import bad_request
from server.logprobs import chat_logprobs
from server.blocking import TemplateTimeout, with_deadline
from jvllm.multimodal.chat import message_text
from jvllm.multimodal.inputs import ProcessedImage
from server.protocol import ChatCompletionRequest, ChatMessage, TextPart, invalid_text_path
from server.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                              DeltaMessage, UsageInfo)
from server.beam_search import beam_search_params, queue_generation
from server.sampling import (cached_details, check_fits, check_generates, check_logprobs, check_model,
                             check_unsupported, sampling_params, tokens_as_ids, truncated, warn_unknown_fields)
from server.settings import REQUEST_TEMPLATE_TIMEOUT_S
from server.state import ServerState
from server.structured import structured_outputs
from server.tools import ToolPlan, plan_tools, template_messages
from server.tool_prompt import template_shows_tools, tools_description, with_tools_described
from server.chat_reply import StreamedReply, one_entry_per_call, whole_reply
from server.streaming import DONE, check_not_failed, include_usage, sse, sse_response, unless_disconnected

_RESERVED_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
                           "continue_final_message"}


def conversation(messages: list[ChatMessage], image_token: str = "") -> list[dict]:
    """Messages as the chat template sees them (text parts joined into one string; a message with images gets one
    `image_token` line per image before its text parts, as vLLM writes it; tool calls' arguments as objects)."""
    result = []
    for message in messages:
        content = message.text()
        if message.image_urls():
            texts = [part.text for part in message.content if isinstance(part, TextPart)]
            content = message_text(texts, len(message.image_urls()), image_token)
        item = {"role": message.role, "content": content}
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        result.append(item)
    return template_messages(result)


async def render_chat(state: ServerState, messages: list[ChatMessage], *, request_template: str | None,
                      add_generation_prompt: bool, continue_final_message: bool, extra: dict | None = None,
                      tools: list[dict] | None = None) -> str:
    """The prompt text, rendered on the blocking-work pool; a template that refuses the conversation is the
    client's error (400). A request's own template needs --trust-request-chat-template and a time bound."""
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    if request_template is not None and not state.settings.trust_request_chat_template:
        raise bad_request("a chat_template in the request is refused: the server runs without "
                          "--trust-request-chat-template", "chat_template")
    state.limits.check_chars(sum(len(message.text()) for message in messages), "messages")
    given = {**(state.settings.default_chat_template_kwargs or {}), **(extra or {})}  # the request's win
    kwargs = {k: v for k, v in given.items() if k not in _RESERVED_TEMPLATE_ARGS}
    if tools:
        kwargs["tools"] = tools
    describe = False  # the tools in a system message, for a template that ignores them
    if tools and request_template is None:
        shows = await template_shows_tools(state)  # logs once when the model cannot see them
        describe = not shows and state.settings.tools_in_system_prompt
    image_token = state.engine.image_token or ""

    def render() -> str:
        turns = conversation(messages, image_token)
        if describe:
            turns = with_tools_described(turns, tools_description(tools, state.settings.tool_call_parser))
        return state.engine.apply_chat_template(turns,
                                                chat_template=request_template or state.settings.chat_template,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, **kwargs)

    try:
        if request_template is None:
            text = await state.blocking.run(render)
        else:
            text = await state.blocking.run(with_deadline, render, REQUEST_TEMPLATE_TIMEOUT_S)
    except TemplateTimeout as error:
        raise bad_request(str(error), "chat_template") from None
    except Exception as error:  # jinja2 errors (e.g. `raise_exception` in a template) and ValueError
        raise bad_request(f"could not apply the chat template: {error}", "messages") from None
    state.limits.check_chars(len(text), "messages")
    if invalid_text_path(text) is not None:  # e.g. a surrogate made by the template from its arguments
        raise bad_request("the rendered chat is not valid UTF-8 text", "messages")
    return text


async def chat_images(state: ServerState, messages: list[ChatMessage]) -> list[ProcessedImage]:
    """The messages' images, loaded (data:, file: under --allowed-local-media-path, http(s)) and preprocessed on the
    blocking-work pool; a refused or unreadable image is a 400 naming the reason."""
    urls = [url for message in messages for url in message.image_urls()]
    if not urls:
        return []
    try:
        return await state.blocking.run(state.engine.load_images, urls)
    except ValueError as error:
        raise bad_request(str(error), "messages") from None


class ChatRun:
    """One chat request on its way: its id, tool plan and prompt size; builds the route's reply or its events."""

    def __init__(self, body: ChatCompletionRequest, state: ServerState, model: str, num_prompt: int,
                 num_top: int | None, tools: ToolPlan):
        self.body, self.state, self.model, self.tools = body, state, model, tools
        self.num_prompt, self.num_top = num_prompt, num_top
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        last = body.messages[-1]
        self.echo = last.text() if body.echo and last.role == "assistant" else ""
        self.always_report_cached = False  # the Responses API reports cache reads in every usage

    def logprobs(self, out: CompletionOutput, start: int = 0) -> ChatLogprobs | None:
        if self.num_top is None or out.logprobs is None:
            return None
        return chat_logprobs(out.token_ids[start:], out.logprobs[start:], self.num_top, self.state.names,
                             tokens_as_ids(self.body.return_tokens_as_token_ids, self.state.settings))

    def usage(self, output: RequestOutput | None) -> UsageInfo:
        completion = sum(len(o.token_ids) for o in output.outputs) if output else 0
        return UsageInfo(prompt_tokens=self.num_prompt, completion_tokens=completion,
                         total_tokens=self.num_prompt + completion,
                         prompt_tokens_details=cached_details(self.state, [output] if output else [],
                                                              self.always_report_cached))

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for o in output.outputs:
            message, finish_reason = whole_reply(o.text, self.tools, self.state.settings.reasoning_parser,
                                                 o.finish_reason, self.echo)
            choices.append(ChatChoice(index=o.index, message=message, logprobs=self.logprobs(o),
                                      finish_reason=finish_reason, stop_reason=o.stop_reason))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(output))

    def chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                    model=self.model, choices=choices)
        if usage is not None:
            chunk.usage = usage
        return sse(chunk)

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        options = self.body.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        replies = {index: StreamedReply(self.tools, self.state.settings.reasoning_parser)
                   for index in range(self.body.n)}
        for index in range(self.body.n):  # the role first, before any token exists, with a forced call's name
            delta = DeltaMessage(role="assistant", content=self.echo)
            opening = replies[index].start()
            if opening is not None:
                delta.tool_calls = opening.tool_calls
            yield self.chunk([ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)],
                             self.usage(None) if continuous else None)
        sent_text: dict[int, int] = {}
        sent_ids: dict[int, int] = {}
        ended: set[int] = set()
        latest = None
        async for output in stream:
            latest = check_not_failed(output)
            for out in output.outputs:
                if out.index in ended:
                    continue
                start = sent_ids.get(out.index, 0)
                finished = out.finish_reason is not None
                delta = replies[out.index].feed(out.text[sent_text.get(out.index, 0):], finished,
                                                out.finish_reason == "length")
                logprobs = self.logprobs(out, start) if len(out.token_ids) > start else None
                sent_text[out.index], sent_ids[out.index] = len(out.text), len(out.token_ids)
                if delta is None and not finished and logprobs is None:
                    continue
                if logprobs is None and self.num_top is not None:
                    logprobs = ChatLogprobs(content=[])  # asked for: always an object, never null
                if finished:
                    ended.add(out.index)
                parts = one_entry_per_call(delta) if delta is not None else [DeltaMessage(content="")]
                for part in parts[:-1]:
                    yield self.chunk([ChatChunkChoice(index=out.index, delta=part, logprobs=None, finish_reason=None)],
                                     self.usage(output) if continuous else None)
                choice = ChatChunkChoice(index=out.index, delta=parts[-1], logprobs=logprobs,
                                         finish_reason=replies[out.index].finish_reason(out.finish_reason),
                                         stop_reason=out.stop_reason)
                yield self.chunk([choice], self.usage(output) if continuous else None)
            if output.finished:
                self.state.log_request(self.id, "finished", output.outputs[0].text)
        if include_usage(options, self.state.settings.enable_force_include_usage):
            yield self.chunk([], self.usage(latest))
        yield DONE


def _check_request(body: ChatCompletionRequest, state: ServerState) -> int | None:
    """-> top logprobs per token (None: no logprobs)."""
    check_unsupported(body, state.limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    check_logprobs(num_top, state.settings, "top_logprobs")
    check_logprobs(body.prompt_logprobs, state.settings, "prompt_logprobs")
    return num_top


async def chat_prompt(body: ChatCompletionRequest, state: ServerState,
                      tools: ToolPlan) -> tuple[str, list[int], list[ProcessedImage]]:
    """The request's prompt as the chat route runs it -> (text, token ids, images); the ids count every image
    token, so length checks and usage see the whole prompt."""
    text = await render_chat(state, body.messages, request_template=body.chat_template,
                             add_generation_prompt=body.add_generation_prompt,
                             continue_final_message=body.continue_final_message, extra=body.chat_template_kwargs,
                             tools=tools.tools or None)
    images = await chat_images(state, body.messages)
    ids = await state.tokenize(text, add_special_tokens=body.add_special_tokens)
    if images:
        try:
            ids = state.engine.expand_image_tokens(ids, images)
        except ValueError as error:
            raise bad_request(str(error), "messages") from None
    return text, ids, images


async def start_chat(body: ChatCompletionRequest, state: ServerState) -> tuple[ChatRun, RequestStream]:
    """The chat route's path up to generation (checks, tool plan, structured outputs, template, limits), the
    request queued: -> the run and its engine stream. Routes that translate to chat start here too."""
    arrival = time.time()
    model = check_model(body.model, state.settings)
    check_generates(model, state)
    num_top = _check_request(body, state)
    state.limits.check_tools(len(body.tools or ()))
    tools = plan_tools(body, state.settings.auto_tool_parser())
    constraint = await structured_outputs(body, state, tools.constraint(bool(body.parallel_tool_calls)))
    text, ids, images = await chat_prompt(body, state, tools)
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    kept = truncated(ids, body, wanted, state.engine.max_model_len)
    if len(kept) < len(ids):
        if images:
            raise bad_request("truncate_prompt_tokens does not apply to prompts with images", "truncate_prompt_tokens")
        text, ids = None, kept
    max_tokens = check_fits(len(ids), wanted, state.engine.max_model_len)
    defaults = state.engine.default_sampling
    if wanted is None and "max_tokens" in defaults:  # the model's max_new_tokens, within the room left
        max_tokens = min(max_tokens, defaults["max_tokens"])
    params = sampling_params(body, max_tokens=max_tokens, logprobs=num_top, prompt_logprobs=body.prompt_logprobs,
                             structured_outputs=constraint, defaults=defaults)
    chat = ChatRun(body, state, model, len(ids), num_top, tools)
    state.log_request(chat.id, "received", text if text is not None else ids, params)
    prompt = {"prompt": text, "prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    stream = await queue_generation(state, prompt, params, beam_search_params(body, params), chat.id,
                                    arrival_time=arrival, priority=body.priority)
    return chat, stream


async def final_output(request: Request, stream: RequestStream) -> RequestOutput:
    """The stream's last output (a failed one raises); the client hanging up aborts the request (ClientGone)."""

    async def last() -> RequestOutput:
        final = None
        async for output in stream:
            final = check_not_failed(output)
        assert final is not None
        return final

    try:
        return await unless_disconnected(request, last())
    finally:
        stream.close()


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    warn_unknown_fields(body, "/v1/chat/completions")
    chat, stream = await start_chat(body, state)
    if body.stream:
        return sse_response(chat.events(stream), [stream], keep_alive_s=state.settings.sse_keep_alive_interval)
    final = await final_output(request, stream)
    state.log_request(chat.id, "finished", final.outputs[0].text)
    return JSONResponse(chat.response(final).model_dump())
