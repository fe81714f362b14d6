"""The engine protocol's bodies, with vLLM's field names and shapes, so one client drives both engines.

The one definition both ends use: the CPU engine (``rollout_server.engine.app``) validates requests
and builds responses with these models, :class:`services.engine_client.EngineClient` builds its
requests and reads the answers (ours and vLLM's) with them. Requests list the subset of vLLM's
``CompletionRequest`` and OpenAI's chat request this engine honours, which is what the official
``openai`` client sends for sampling, stop strings, penalties, log-probs, streaming, tools and
``user``; an unknown field is a 422 rather than silently ignored (vLLM ignores it), so a client
never believes a setting took effect when it did not, and a setting the engine cannot honour
(``response_format`` JSON) is a 400 that says so. Responses are vLLM's ``CompletionResponse`` as
its server fills it for ``logprobs: 0, return_token_ids: true``, OpenAI's chat completion, and
the chunks of both as server-sent events; fields this engine leaves null are typed as vLLM
fills them, so the client reads vLLM's answers with the same models.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from services.json_types import WHOLE_FLOATS

TokenId = Annotated[int, Field(ge=0), WHOLE_FLOATS]
Count = Annotated[int, Field(ge=1), WHOLE_FLOATS]
TopK = Annotated[int, Field(ge=-1), WHOLE_FLOATS]
SamplingSeed = Annotated[int, Field(ge=-(2**63), lt=2**63), WHOLE_FLOATS]
REQUEST = ConfigDict(extra="forbid", strict=True)
"""Requests: unknown fields refused, and JSON types exact (no ``true`` for a token id, see
:mod:`services.json_types`)."""
MAX_LOGPROBS = 20
"""The most top log-probs a request may ask for per token (OpenAI's limit, vLLM's default)."""
StopString = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TRAINER_NOTE = (
    " The reported log-probs are of the distribution after it; the trainer recomputes log-probs "
    "without it, so training on such samples makes the PPO ratio inexact."
)


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``; only with ``stream: true`` (else a 400, as vLLM answers)."""

    model_config = REQUEST

    include_usage: bool | None = Field(
        default=None, description="True: a last chunk before [DONE] with the usage and no choices."
    )


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``. ``text`` is what the engine does anyway; ``json_object`` and
    ``json_schema`` need decoding constrained to JSON, which vLLM does and this engine cannot:
    they are a 400 (``unsupported_response_format``), never silently ignored."""

    model_config = REQUEST

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(BaseModel):
    """The sampling and stopping fields both generation routes share, as vLLM names them."""

    model_config = REQUEST

    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = None
    seed: SamplingSeed | None = None
    n: Count = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = Field(
        default=None,
        description="Up to 4 strings: generation ends once the decoded output holds one "
        "(finish_reason 'stop', stop_reason the string). The text is cut before it; token_ids and "
        "log-probs keep every sampled token, the one that completed it included.",
    )
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = Field(
        default=None,
        description="OpenAI's: subtracted from the logit of every token already generated in this "
        "sequence, before temperature, top-k and top-p." + TRAINER_NOTE,
    )
    frequency_penalty: Penalty | None = Field(
        default=None,
        description="OpenAI's: times the number of times a token was generated in this sequence, "
        "subtracted from its logit, with the presence penalty, before temperature, top-k and top-p."
        + TRAINER_NOTE,
    )
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="vLLM's (and Hugging Face's): positive logits of tokens seen in the prompt or the "
        "output are divided by it, negative ones multiplied; 1 (the default) is none. Applied before "
        "the presence and frequency penalties." + TRAINER_NOTE,
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None,
        description="Token id (as a string) -> bias added to its logit before the penalties; a key "
        "that is not a token id of this model is a 400 (bad_logit_bias)." + TRAINER_NOTE,
    )
    user: str | None = Field(default=None, description="Accepted and ignored, as vLLM does.")
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    stream: bool | None = Field(
        default=False,
        description="True: server-sent events, each 'data: <chunk JSON>', tokens as they are generated, "
        "then 'data: [DONE]'. A client that disconnects ends its sequences.",
    )
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``; unset sampling fields take vLLM's defaults (T=1, top-p 1, no top-k).

    Some limits are documented here and checked by the engine, which answers 400 with vLLM's
    codes: a non-empty prompt, and (in each server's document) its ``n``, vocabulary and context.
    """

    model: str | None = None
    prompt: list[TokenId] | str = Field(
        description="Token ids (the worker's own tokens) or text.",
        json_schema_extra={"minItems": 1, "minLength": 1},
    )
    max_tokens: Count | None = Field(default=16, description="None: vLLM's 16.")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE_FLOATS] | None = Field(
        default=None,
        description="The sampled token's log-prob (of the distribution it was drawn from) and, in "
        "top_logprobs, those of the N most likely tokens of that distribution besides it (vLLM's).",
    )
    return_token_ids: bool | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamChoice(BaseModel):
    """One choice's piece of a streamed completion: the text (and tokens) since the last chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = Field(default=None, description="vLLM: its version.")
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed completion (vLLM's ``CompletionStreamResponse``); the
    last, with ``stream_options.include_usage``, has no choices and the usage."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class TextContentPart(BaseModel):
    """One part of a message whose ``content`` is a list (OpenAI's multi-part form); text only."""

    model_config = REQUEST

    type: Literal["text"]
    text: str


MessageContent = str | list[TextContentPart]


def content_text(content: MessageContent | None) -> str:
    """A message's content as one string (its text parts joined; none: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class SystemMessage(BaseModel):
    """``system``, or ``developer`` (OpenAI's newer name for it), which the template sees as system."""

    model_config = REQUEST

    role: Literal["system", "developer"]
    content: MessageContent
    name: str | None = None


class UserMessage(BaseModel):
    model_config = REQUEST

    role: Literal["user"]
    content: MessageContent
    name: str | None = None


class AssistantFunctionCall(BaseModel):
    model_config = REQUEST

    name: str
    arguments: str = Field(
        description="A JSON object as a string, as OpenAI returns it; the engine parses it for the "
        "template (a string that is not a JSON object is a 400, bad_tool_call_arguments)."
    )


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the agent sends it back."""

    model_config = REQUEST

    id: str
    type: Literal["function"] = "function"
    function: AssistantFunctionCall


class AssistantMessage(BaseModel):
    model_config = REQUEST

    role: Literal["assistant"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    refusal: str | None = Field(default=None, description="Accepted and ignored.")
    # An agent that appends the SDK's reply message object as it came sends these back too.
    annotations: list[dict[str, Any]] | None = Field(default=None, description="Accepted and ignored.")
    audio: dict[str, Any] | None = Field(default=None, description="Accepted and ignored.")
    function_call: dict[str, Any] | None = Field(
        default=None, description="OpenAI's deprecated single call; accepted and ignored."
    )


class ToolMessage(BaseModel):
    """The result of a tool call, for the template as ``{"role": "tool", "content": ...}``."""

    model_config = REQUEST

    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(BaseModel):
    model_config = REQUEST

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON Schema of the arguments.")
    strict: bool | None = Field(default=None, description="Accepted; the CPU engine cannot enforce it.")


class ChatTool(BaseModel):
    """An OpenAI function tool, passed to the chat template as ``tools=``."""

    model_config = REQUEST

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = REQUEST

    name: str


class NamedToolChoice(BaseModel):
    model_config = REQUEST

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: OpenAI's chat request (the fields this engine honours).

    The messages go through the model's chat template with its generation prompt (and ``tools``);
    sampling is the same as for ``/v1/completions``. Without ``max_tokens``/``max_completion_tokens``
    the reply may fill the rest of the context, as vLLM does. Unknown fields are a 422, as for
    completions.
    """

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = Field(
        default=None, description="OpenAI's newer name of max_tokens; the smaller wins when both are set."
    )
    logprobs: bool | None = Field(
        default=None,
        description="True: choices[i].logprobs.content, the log-prob of each sampled token under the "
        "distribution it was drawn from (after penalties, temperature, top-k, top-p).",
    )
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE_FLOATS] | None = Field(
        default=None,
        description="With logprobs: the N most likely tokens of that distribution at each position "
        "(without logprobs: a 400, as OpenAI and vLLM answer).",
    )
    tools: list[ChatTool] | None = Field(
        default=None,
        description="Function tools, rendered into the prompt by the model's chat template (a "
        "template that does not use them ignores them). Unless tool_choice is 'none', the reply is "
        'parsed for Hermes/Qwen tool calls (<tool_call>{"name": ..., "arguments": {...}}</tool_call>) '
        "into message.tool_calls, finish_reason 'tool_calls'.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="'none': the reply is not parsed for tool calls. 'required' and a named function "
        "are accepted but treated like 'auto': without guided decoding the CPU engine cannot force "
        "the model to call a tool (vLLM can). A named function must be one of tools.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="False: only the first tool call of a reply is returned."
    )


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What a chunk adds to a choice's message; fields it does not add are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (OpenAI's ``chat.completion.chunk``); the
    last, with ``stream_options.include_usage``, has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "stargym"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CollectiveRpcRequest(BaseModel):
    """vLLM passes ``method`` to every worker; this engine knows ``reload_weights`` only (the
    document says so; another method is a 400 naming the one it knows)."""

    model_config = ConfigDict(strict=True)

    method: str = Field(json_schema_extra={"enum": ["reload_weights"]})
    args: list[str] = Field(default_factory=list)
    kwargs: dict[str, str | None] = Field(default_factory=dict)
    timeout: float | None = None


class CollectiveRpcResponse(BaseModel):
    results: list[None]


class PauseStatus(BaseModel):
    status: Literal["paused", "resumed"]


class IsPaused(BaseModel):
    is_paused: bool


class WeightVersionUpdate(BaseModel):
    model_config = ConfigDict(strict=True)

    new_version: str


class WeightVersionUpdated(BaseModel):
    success: bool = True
    new_version: str


class WeightInfo(BaseModel):
    weight_version: str
