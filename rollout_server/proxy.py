"""The rollout worker's recording proxy: OpenAI's chat API per agent session, on the worker's port.

``/sessions/{id}/v1`` is an OpenAI base URL: point any OpenAI client at it. Each session is
one agent episode (:mod:`rollout_server.agent`); what its calls sample is recorded by
:class:`~rollout_server.session.RecordingSession`. Routes:

* ``POST /sessions/{id}/v1/chat/completions``: OpenAI's chat request as the engine's own route
  takes it (``services.engine_protocol.ChatCompletionRequest``). ``stream: true`` answers with
  server-sent events in OpenAI's chunk format, sent once the reply is complete: the session
  records whole replies, and an agent reads a stream the same way whatever its pacing.
* ``GET /sessions/{id}/v1/models``: the one model a session serves (any name is accepted).
* ``POST /sessions/{id}/finish``: an outside harness ends its episode
  (``services.agent_protocol.SessionFinish``).
* ``POST /sessions``: a harness takes the next episode of a ``pull`` run (201 with its
  ``HarnessCall``; 204 when none is waiting: poll).

An unknown or closed session is a 404, a finished one a 409.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from rollout_server.agent import MODEL_NAME
from rollout_server.session import SessionRegistry
from services.agent_protocol import HarnessCall, SessionFinish, SessionFinished
from services.engine_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ModelCard,
    ModelList,
)
from services.http_app import dumps_json, error_responses

router = APIRouter(prefix="/sessions", tags=["agent sessions"])
DONE = "data: [DONE]\n\n"


def _sessions(request: Request) -> SessionRegistry:
    return request.app.state.worker.sessions  # type: ignore[no-any-return]


@router.post(
    "",
    response_model=HarnessCall,
    status_code=201,
    responses={204: {"description": "No episode is waiting for a harness now: ask again later."}},
)
async def take_session(request: Request) -> Any:
    """A harness takes the next episode of a run whose agent is ``pull``: its session's base URL,
    where to finish it, and the task. Answers at once: 204 while none is waiting (poll)."""
    call = _sessions(request).take()
    return Response(status_code=204) if call is None else call


@router.post(
    "/{session_id}/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=error_responses(400, 404, 409, 502),
)
async def chat_completions(session_id: str, body: ChatCompletionRequest, request: Request) -> Any:
    """One chat call of the session's agent: sampled by the policy, recorded for training."""
    session = _sessions(request).get(session_id)
    response = await session.complete(body)
    if not body.stream:
        return response
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_events(response, include_usage), media_type="text/event-stream")


@router.get("/{session_id}/v1/models", response_model=ModelList, responses=error_responses(404, 409))
async def models(session_id: str, request: Request) -> ModelList:
    """The model this session samples from: the policy the worker's engines serve now."""
    session = _sessions(request).get(session_id)
    return ModelList(
        data=[
            ModelCard(
                id=MODEL_NAME,
                root=f"policy-v{session.policy_version}",
                max_model_len=session.max_model_len or 0,
            )
        ]
    )


@router.post("/{session_id}/finish", response_model=SessionFinished, responses=error_responses(404, 409))
async def finish(session_id: str, body: SessionFinish, request: Request) -> SessionFinished:
    """The harness's episode is over: its reward (None: the env's), and the session closes."""
    session = _sessions(request).finish(session_id, body)
    record = session.record
    return SessionFinished(session_id=session_id, turns=len(record.turns), segments=len(record.segments) + 1)


def _events(response: ChatCompletionResponse, include_usage: bool) -> Iterator[str]:
    """The reply as OpenAI's chunks: the role and text, the tool calls, the finish, the usage."""
    choice = response.choices[0]

    def chunk(delta: DeltaMessage, **fields: Any) -> str:
        payload = ChatCompletionChunk(
            id=response.id,
            created=response.created,
            model=response.model,
            choices=[ChatCompletionStreamChoice(index=0, delta=delta, **fields)],
        )
        return f"data: {dumps_json(payload.model_dump(mode='json')).decode()}\n\n"

    yield chunk(
        DeltaMessage(role="assistant", content=choice.message.content or ""), logprobs=choice.logprobs
    )
    if choice.message.tool_calls:
        calls = [
            DeltaToolCall(
                index=index,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for index, call in enumerate(choice.message.tool_calls)
        ]
        yield chunk(DeltaMessage(tool_calls=calls))
    yield chunk(DeltaMessage(), finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
    if include_usage:
        usage = ChatCompletionChunk(
            id=response.id, created=response.created, model=response.model, choices=[], usage=response.usage
        )
        yield f"data: {dumps_json(usage.model_dump(mode='json')).decode()}\n\n"
    yield DONE
