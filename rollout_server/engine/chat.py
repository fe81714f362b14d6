"""The chat route's text work: messages for the chat template, and tool calls parsed from replies.

Messages go to the template as transformers expects them (what vLLM passes too): ``developer``
becomes ``system``; an assistant turn's ``tool_calls`` keep OpenAI's shape with
``function.arguments`` parsed from its JSON string into a dict (Qwen's and Hermes' templates
write it with ``tojson``); a tool result is ``{"role": "tool", "content": ...}`` (with its
``tool_call_id``, which some templates read); a missing assistant content is an empty string,
which every template can concatenate.

Replies are parsed for tool calls in the Hermes format that Qwen2.5 and Qwen3 emit and vLLM's
``hermes`` parser reads: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, as many
as the model wrote. A reply whose block is not such JSON is returned as plain text, as vLLM does:
a model's malformed call is the model's answer, never a server error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.engine_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    FunctionCall,
    SamplingFields,
    SystemMessage,
    ToolCall,
    ToolMessage,
    content_text,
)
from services.errors import bad_request

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# A block runs to its end tag, or to the end of the reply if the model stopped before writing it
# (max_tokens, a stop string), as vLLM's hermes parser reads it.
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def refuse_unsupported(body: SamplingFields) -> None:
    """What no OpenAI route of ours can do, refused as vLLM refuses what it cannot: JSON
    ``response_format`` (no guided decoding), ``stream_options`` without ``stream``, and on chat
    ``top_logprobs`` without ``logprobs``. Shared by the engine's routes and the recording proxy."""
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(
            "unsupported_response_format",
            f"response_format {body.response_format.type!r}: the CPU engine cannot constrain decoding to "
            "JSON; use vLLM (or ask for JSON in the prompt and parse the text)",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options_without_stream", "stream_options is only allowed with stream: true")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs_without_logprobs", "top_logprobs needs logprobs: true")


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as dicts for ``apply_chat_template``; a 400 for tool-call arguments
    that are not a JSON object."""
    messages: list[dict[str, Any]] = []
    for position, message in enumerate(request.messages):
        if isinstance(message, SystemMessage):
            messages.append({"role": "system", "content": content_text(message.content)})
        elif isinstance(message, ToolMessage):
            messages.append(
                {
                    "role": "tool",
                    "content": content_text(message.content),
                    "tool_call_id": message.tool_call_id,
                }
            )
        elif isinstance(message, AssistantMessage):
            rendered: dict[str, Any] = {"role": "assistant", "content": content_text(message.content)}
            if message.tool_calls:
                rendered["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": call.type,
                        "function": {
                            "name": call.function.name,
                            "arguments": _arguments(call.function.arguments, position),
                        },
                    }
                    for call in message.tool_calls
                ]
            messages.append(rendered)
        else:
            messages.append({"role": message.role, "content": content_text(message.content)})
    return messages


def _arguments(text: str, position: int) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(
            "bad_tool_call_arguments",
            f"messages[{position}]: a tool call's function.arguments must be a JSON object as a string, "
            f"got {text[:80]!r}",
        )
    return arguments


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """``tools=`` for the template (OpenAI's function tools as dicts); a 400 for a ``tool_choice``
    the tools cannot satisfy, as OpenAI and vLLM answer."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice_without_tools", "tool_choice needs tools: the request has none")
        return None
    if choice is not None and not isinstance(choice, str):
        names = [tool.function.name for tool in request.tools]
        if choice.function.name not in names:
            raise bad_request(
                "unknown_tool",
                f"tool_choice names the function {choice.function.name!r}, which is not among tools ({names})",
            )
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def parses_tool_calls(request: ChatCompletionRequest) -> bool:
    """Whether replies are parsed for tool calls: tools were given and tool_choice is not 'none'."""
    return bool(request.tools) and request.tool_choice != "none"


@dataclass
class ParsedReply:
    """A reply split into the text outside its tool-call blocks (None if only whitespace) and the calls.

    malformed: the reply opened a tool-call block that does not parse (a call the model wrote
    badly). It is answered as plain content, as vLLM does; a recording session also marks its
    turn invalid, so the run's ``invalid_penalty`` and invalid-rate metrics see it.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: bool = False


def parse_tool_calls(text: str, parallel: bool = True) -> ParsedReply:
    """The Hermes/Qwen tool calls in ``text``; the whole text as content if there is none or a block
    does not parse (then ``malformed``). ``parallel`` False keeps the first call only."""
    blocks = list(TOOL_CALL_BLOCK.finditer(text))
    if not blocks:
        return ParsedReply(content=text)
    calls = []
    for block in blocks:
        call = _tool_call(block.group(1) if block.group(1) is not None else block.group(2))
        if call is None:
            return ParsedReply(content=text, malformed=True)
        calls.append(call)
    outside = TOOL_CALL_BLOCK.sub("", text)
    return ParsedReply(
        content=outside if outside.strip() else None, tool_calls=calls if parallel else calls[:1]
    )


def _tool_call(body: str) -> ToolCall | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        return None
    return ToolCall(function=FunctionCall(name=parsed["name"], arguments=arguments))
