"""OpenAPI for the streamed routes: a `text/event-stream` body described event by event."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.anthropic_protocol import MessageStreamEvent
from server.responses import ChatCompletionChunk, CompletionResponse, ErrorResponse
from server.responses_api_protocol import ResponseStreamEvent

_CHUNK_KEY = "x-jvllm-stream-chunk"
_CHUNKS: dict[str, type[BaseModel]] = {model.__name__: model for model in (CompletionResponse, ChatCompletionChunk,
                                                                           ResponseStreamEvent, MessageStreamEvent)}


def streamed(chunk: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that streams `chunk` objects as server-sent events when stream=true."""
    assert chunk.__name__ in _CHUNKS, chunk
    return {_CHUNK_KEY: chunk.__name__}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def event_schema(chunk_name: str) -> dict[str, Any]:
    """One event as OpenAPI (before 3.2) reads a `text/event-stream` schema: its `data` field is a JSON chunk,
    a JSON error object (an error after the headers were sent), or `[DONE]`, the last event."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk_name), _ref(ErrorResponse.__name__)]}}
    return {"type": "object", "required": ["data"],
            "description": f"one server-sent event: `data` holds a {chunk_name} as JSON, an error object, or "
                           "[DONE] as the last event",
            "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                           "data": {"type": "string", "if": {"const": "[DONE]"}, "else": payload}}}


def _add_component(components: dict[str, Any], model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(model.__name__, schema)


def document_event_streams(app: FastAPI) -> None:
    """Replace `app.openapi` with one that adds the event-stream body to every `streamed(...)` route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = document.setdefault("components", {}).setdefault("schemas", {})
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                chunk_name = operation.pop(_CHUNK_KEY, None)
                if chunk_name is None:
                    continue
                for model in (_CHUNKS[chunk_name], ErrorResponse):
                    _add_component(components, model)
                content = operation["responses"]["200"].setdefault("content", {})
                content["text/event-stream"] = {"schema": event_schema(chunk_name)}
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
