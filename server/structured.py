"""`response_format` and `structured_outputs` to StructuredOutputsParams, checked off the event loop (400s)."""
from __future__ import annotations

from jvllm.sampling_params import StructuredOutputsParams
from server.api_errors import bad_request
from server.protocol import SamplingFields
from server.state import ServerState


def requested_constraint(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """-> the request's output constraint (None: free text) and the field that asked for it."""
    wants_format = body.response_format is not None and body.response_format.type != "text"
    if wants_format and body.structured_outputs is not None:
        raise bad_request("give either response_format or structured_outputs, not both", "structured_outputs")
    if wants_format:
        return _from_response_format(body), "response_format"
    if body.structured_outputs is None:
        return None, "structured_outputs"
    fields = body.structured_outputs
    try:
        return StructuredOutputsParams(json=fields.json_, regex=fields.regex, choice=fields.choice,
                                       grammar=fields.grammar, json_object=fields.json_object), "structured_outputs"
    except ValueError as error:
        raise bad_request(str(error), "structured_outputs") from None


def _from_response_format(body: SamplingFields) -> StructuredOutputsParams:
    response_format = body.response_format
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          "response_format.json_schema")
    return StructuredOutputsParams(json=spec.schema_)


async def structured_outputs(body: SamplingFields, state: ServerState,
                             tool_calls: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
    """The request's constraint, its grammar compiled once on the blocking-work pool: a schema, regex or grammar
    that does not compile is a 400 naming the field, before anything is queued. `tool_calls`: the constraint that
    forces a required or named tool choice."""
    params, field = requested_constraint(body)
    if tool_calls is not None:
        if params is not None:
            raise bad_request(f"a required or named tool_choice cannot be combined with {field}", field)
        params, field = tool_calls, "tools"
    if params is None:
        return None
    try:
        await state.blocking.run(state.engine.check_structured_outputs, params)
    except ValueError as error:
        message = str(error)
        if field in ("response_format", "tools"):
            where = "a function's parameters" if field == "tools" else "response_format.json_schema.schema"
            message = message.replace("structured_outputs.json", where, 1)
            param = field
        else:
            param = f"structured_outputs.{params.kind}"
        raise bad_request(message, param) from None
    return params
