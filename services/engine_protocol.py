"""The engine protocol's bodies, with vLLM's field names and shapes, so one client drives both engines.

The one definition both ends use: the CPU engine (``rollout_server.engine.app``) validates requests
and builds responses with these models, :class:`services.engine_client.EngineClient` builds its
requests and reads the answers (ours and vLLM's) with them. Requests list the subset of vLLM's ``CompletionRequest`` (and OpenAI's chat request) this engine honours; an unknown field is
a 422 rather than silently ignored (vLLM ignores it), so a client never believes a setting took
effect when it did not. Responses are vLLM's ``CompletionResponse`` as its server fills it for
``logprobs: 0, return_token_ids: true``; fields this engine leaves null are typed as vLLM fills
them, so the client reads vLLM's answers with the same models.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.json_types import BOOLEANS_ONLY, WHOLE_FLOATS

TokenId = Annotated[int, Field(ge=0), WHOLE_FLOATS]
Count = Annotated[int, Field(ge=1), WHOLE_FLOATS]
TopK = Annotated[int, Field(ge=-1), WHOLE_FLOATS]
SamplingSeed = Annotated[int, Field(ge=-(2**63), lt=2**63), WHOLE_FLOATS]
NoStreaming = Annotated[Literal[False], BOOLEANS_ONLY]
REQUEST = ConfigDict(extra="forbid", strict=True)
"""Requests: unknown fields refused, and JSON types exact (no ``true`` for a token id, see
:mod:`services.json_types`)."""


class CompletionRequest(BaseModel):
    """``POST /v1/completions``; unset sampling fields take vLLM's defaults (T=1, top-p 1, no top-k).

    Some limits are documented here and checked by the engine, which answers 400 with vLLM's
    codes: a non-empty prompt, ``logprobs`` 0, and (in each server's document) its ``n``,
    vocabulary and context.
    """

    model_config = REQUEST

    model: str | None = None
    prompt: list[TokenId] | str = Field(
        description="Token ids (the worker's own tokens) or text.",
        json_schema_extra={"minItems": 1, "minLength": 1},
    )
    max_tokens: Count | None = Field(default=16, description="None: vLLM's 16.")
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = None
    seed: SamplingSeed | None = None
    n: Count = 1
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    logprobs: Annotated[int, Field(ge=0), WHOLE_FLOATS] | None = Field(
        default=None,
        description="0: the sampled token's log-prob (the only count this engine serves).",
        json_schema_extra={"maximum": 0},
    )
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    stream: NoStreaming | None = False


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


class TextContentPart(BaseModel):
    """One part of a message whose ``content`` is a list (OpenAI's multi-part form); text only."""

    model_config = REQUEST

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = REQUEST

    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's chat request (the fields this engine honours).

    The messages go through the model's chat template with its generation prompt; sampling is
    the same as for ``/v1/completions``. Without ``max_tokens``/``max_completion_tokens`` the
    reply may fill the rest of the context, as vLLM does. Unknown fields are a 422, as for
    completions.
    """

    model_config = REQUEST

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = Field(
        default=None, description="OpenAI's newer name of max_tokens; the smaller wins when both are set."
    )
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = None
    seed: SamplingSeed | None = None
    n: Count = 1
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: NoStreaming | None = False


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


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
