"""A Responses API request as the chat request it runs as: input items to chat messages, its settings to chat's."""
from __future__ import annotations

from server.api_errors import bad_request
from server.protocol import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, ImagePart, ImageURL,
                             JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseFormat, TextPart, Tool, ToolCall)
from server.responses_api_protocol import (FunctionCallInput, FunctionCallOutputInput, FunctionToolChoice,
                                           InputImagePart, MessageInput, ReasoningInput, ResponsesRequest)

# Chat's parameter names in errors, as the Responses API names them.
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_param(param: str | None) -> str | None:
    return _PARAMS.get(param, param) if param is not None else None


def _parts(content: str | list, where: str) -> str | list[TextPart | ImagePart]:
    if isinstance(content, str):
        return content
    parts: list[TextPart | ImagePart] = []
    for index, part in enumerate(content):
        if isinstance(part, InputImagePart):
            if part.image_url is None:
                raise bad_request("an input_image needs image_url (file_id is not supported)",
                                  f"{where}.content.{index}")
            parts.append(ImagePart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail)))
        else:
            text = part.refusal if part.type == "refusal" else part.text
            parts.append(TextPart(type="text", text=text))
    return parts


def input_messages(items: str | list) -> list[ChatMessage]:
    """The input as chat messages: a string is one user message; an assistant's function calls join the assistant
    message before them (or make one); a function call's output is a tool message; reasoning items are dropped."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        if isinstance(item, MessageInput):
            messages.append(ChatMessage(role=item.role, content=_parts(item.content, where)))
        elif isinstance(item, FunctionCallInput):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputInput):
            messages.append(ChatMessage(role="tool", content=_parts(item.output, where), tool_call_id=item.call_id))
        else:
            assert isinstance(item, ReasoningInput)
    return messages


def _tool_choice(choice: str | FunctionToolChoice | None) -> str | NamedToolChoice | None:
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return choice


def forces_calls(body: ResponsesRequest) -> bool:
    """A required or named tool choice: the reply is calls only."""
    return bool(body.tools) and (body.tool_choice == "required" or isinstance(body.tool_choice, FunctionToolChoice))


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    """`text.format`; left out when the tool choice forces calls, as the reply then has no text to shape."""
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text" or forces_calls(body):
        return None
    if text_format.type == "json_object":
        return ResponseFormat(type="json_object")
    if text_format.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema", "text.format.schema")
    spec = JsonSchemaFormat(name=text_format.name or "response", description=text_format.description,
                            schema=text_format.schema_, strict=text_format.strict)
    return ResponseFormat(type="json_schema", json_schema=spec)


def chat_request(body: ResponsesRequest, history: list[ChatMessage]) -> tuple[ChatCompletionRequest,
                                                                               list[ChatMessage]]:
    """-> the chat request to run, and the conversation without the instructions (what a later turn continues):
    `history` (a previous response's conversation), then this input."""
    conversation = [*history, *input_messages(body.input)]
    if not conversation:
        raise bad_request("input must not be empty", "input")
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    tools = [Tool(function=FunctionDefinition(name=tool.name, description=tool.description,
                                              parameters=tool.parameters, strict=tool.strict))
             for tool in body.tools or ()]
    request = ChatCompletionRequest(
        model=body.model, messages=[*system, *conversation], max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=tools or None, tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, response_format=_response_format(body))
    return request, conversation
