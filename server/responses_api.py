"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API, run as a chat completion."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server.chat import final_output, start_chat
from server.api_errors import APIError
from server.protocol import ChatMessage
from server.response_store import StoredResponse
from server.responses_api_protocol import ResponseObject, ResponsesRequest
from server.responses_input import chat_request, responses_param
from server.responses_output import ResponseShell, assistant_message, reply_items
from server.responses_stream import EventWriter, ResponseEvents
from server.sampling import warn_unknown_fields
from server.state import ServerState
from server.streaming import sse_response


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


def _history(body: ResponsesRequest, state: ServerState) -> list[ChatMessage]:
    """The conversation that `previous_response_id` continues (none without one); 404 for an unknown id."""
    if body.previous_response_id is None:
        return []
    stored = state.responses.get(body.previous_response_id)
    if stored is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    return stored.messages


async def create_response(body: ResponsesRequest, request: Request, state: ServerState) -> Response:
    warn_unknown_fields(body, "/v1/responses")
    chat_body, conversation = chat_request(body, _history(body, state))
    try:
        chat, stream = await start_chat(chat_body, state)
    except APIError as error:  # chat's checks name chat's fields
        error.param = responses_param(error.param)
        raise
    chat.always_report_cached = True
    shell = ResponseShell(body, chat.model)

    def remember(response: ResponseObject) -> None:
        if body.store:
            state.responses.put(response.id, StoredResponse(response.model_dump(by_alias=True),
                                                            [*conversation, assistant_message(response.output)]))

    if body.stream:
        writer = EventWriter()
        return sse_response(ResponseEvents(shell, chat, writer, remember).events(stream), [stream],
                            on_error=writer.error, keep_alive_s=state.settings.sse_keep_alive_interval)
    final = await final_output(request, stream)
    state.log_request(chat.id, "finished", final.outputs[0].text)
    reply = chat.response(final)
    cut = final.outputs[0].finish_reason == "length"
    response = shell.build(reply_items(reply.choices[0].message, cut), reply.usage, cut=cut)
    remember(response)
    return JSONResponse(response.model_dump(by_alias=True))


async def retrieve_response(response_id: str, state: ServerState) -> Response:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.response)
