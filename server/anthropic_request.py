"""An Anthropic Messages request as the chat-completions request that runs it."""
from __future__ import annotations

import json

from server.anthropic_protocol import (AnthropicTool, AnthropicToolChoice, Base64ImageSource, CountTokensRequest,
                                       ImageBlock, InputMessage, MessagesRequest, TextBlock, ToolResultBlock,
                                       ToolUseBlock)
from server.api_errors import bad_request
from server.protocol import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, ImagePart, ImageURL,
                             NamedFunction, NamedToolChoice, TextPart, Tool, ToolCall)

Part = TextPart | ImagePart


def _part(block: TextBlock | ImageBlock) -> Part:
    if isinstance(block, TextBlock):
        return TextPart(type="text", text=block.text)
    source = block.source
    url = (f"data:{source.media_type};base64,{source.data}" if isinstance(source, Base64ImageSource)
           else source.url)
    return ImagePart(type="image_url", image_url=ImageURL(url=url))


def _tool_message(block: ToolResultBlock) -> ChatMessage:
    """A tool_result as the `tool` message answering its call; an error's text follows 'Error: '."""
    if block.content is None or isinstance(block.content, str):
        content: str | list[Part] = block.content or ""
        if block.is_error:
            content = f"Error: {content}"
    else:
        content = [_part(item) for item in block.content]
        if block.is_error:
            content.insert(0, TextPart(type="text", text="Error: "))
    return ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id)


def _tool_call(block: ToolUseBlock) -> ToolCall:
    return ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input)))


def chat_messages(message: InputMessage, where: str) -> list[ChatMessage]:
    """One Anthropic message -> chat messages: a user turn's tool_result blocks become `tool` messages (in their
    place among its text and images), an assistant turn's tool_use blocks its tool_calls; thinking is left out."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    result: list[ChatMessage] = []
    parts: list[Part] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(message.content):
        if isinstance(block, (TextBlock, ImageBlock)):
            parts.append(_part(block))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise bad_request("tool_use blocks belong in assistant messages", f"{where}.content.{index}")
            calls.append(_tool_call(block))
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise bad_request("tool_result blocks belong in user messages", f"{where}.content.{index}")
            if parts:
                result.append(ChatMessage(role="user", content=parts))
                parts = []
            result.append(_tool_message(block))
    if message.role == "assistant":
        result.append(ChatMessage(role="assistant", content=parts or None, tool_calls=calls or None))
    elif parts or not result:
        result.append(ChatMessage(role="user", content=parts))
    return result


def _tools(tools: list[AnthropicTool] | None) -> list[Tool] | None:
    if tools is None:
        return None
    return [Tool(function=FunctionDefinition(name=tool.name, description=tool.description,
                                             parameters=tool.input_schema)) for tool in tools]


def _tool_choice(choice: AnthropicToolChoice | None) -> str | NamedToolChoice | None:
    """auto -> auto, any -> required, tool -> the named function, none -> none (no choice: the chat default)."""
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request('a tool_choice of type "tool" needs the name of the tool', "tool_choice.name")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders (and, for a MessagesRequest, runs) `body`: the system text as a system
    message, one reply (n=1). A final assistant message is continued (prefill)."""
    messages: list[ChatMessage] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else [_part(block) for block in body.system]
        messages.append(ChatMessage(role="system", content=system))
    for index, message in enumerate(body.messages):
        messages.extend(chat_messages(message, f"messages.{index}"))
    prefill = body.messages[-1].role == "assistant"
    choice = body.tool_choice
    fields = dict(model=body.model, messages=messages, tools=_tools(body.tools), tool_choice=_tool_choice(choice),
                  parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
                  add_generation_prompt=not prefill, continue_final_message=prefill)
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k)
    return ChatCompletionRequest(**fields)
