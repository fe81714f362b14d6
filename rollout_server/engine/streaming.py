"""``stream: true``: the generation routes as server-sent events, tokens sent as they are sampled.

The events are what the OpenAI API and vLLM send: ``data: <chunk JSON>\\n\\n`` per chunk, then
``data: [DONE]\\n\\n``. A chat stream opens each choice with ``delta: {"role": "assistant",
"content": ""}``, adds ``delta.content`` pieces, and ends the choice with a chunk carrying its
``finish_reason`` (and, for a reply parsed into tool calls, ``delta.tool_calls``, each call whole
in one piece); a completion stream sends ``text_completion`` chunks with ``text`` pieces. With
``stream_options.include_usage`` a last chunk has no choices and the usage. Log-probs (and
``token_ids`` for completions with ``return_token_ids``) ride with the chunk whose text they
produced, so the pieces of a stream join into the plain reply.

How a token gets here: the engine thread calls each sequence's ``on_token`` after the token,
which hands a snapshot (tokens so far, text so far) to the event loop with
``loop.call_soon_threadsafe``; the sequence's ``done`` future posts its end the same way, after
its last token. Snapshots that pile up while the client reads are merged, latest first, into one
chunk per choice. The text comes from the engine thread's incremental detokeniser
(:class:`rollout_server.engine.detokenize.IncrementalText`), which never holds a partial UTF-8
character; here a tail that could still become a stop string (or, when tool calls are parsed, a
``<tool_call>`` tag) waits for the next token. Once a choice may hold tool calls (a ``<tool_call>``
appeared), its text waits for the end, where the reply is parsed as the plain route parses it.

A client that disconnects ends the response task; :class:`EngineStream` then aborts the
sequences still running, so their slots are free at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rollout_server.engine.chat import TOOL_CALL_START, parse_tool_calls
from rollout_server.engine.detokenize import unsent_stop_prefix
from rollout_server.engine.openai_format import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    final_text,
    finish_reason,
)
from rollout_server.engine.scheduler import Engine
from rollout_server.engine.scheduler import Sequence as EngineSequence
from services.engine_protocol import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)
from services.http_app import dumps_json

DONE = "data: [DONE]\n\n"


class EngineStream(StreamingResponse):
    """A ``text/event-stream`` response that aborts its sequences if it ends before they do
    (the client went away, or the task was cancelled), whether or not it had started."""

    def __init__(self, events: AsyncIterator[str], engine: Engine, sequences: list[EngineSequence]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.engine = engine
        self.sequences = sequences

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            unfinished = [sequence for sequence in self.sequences if not sequence.done.done()]
            if unfinished:
                self.engine.abort(unfinished)


@dataclass(frozen=True, slots=True)
class Progress:
    """One choice's state as the engine thread last reported it; ``tokens`` None: it finished."""

    index: int
    tokens: int | None
    text: str = ""


class ProgressQueue:
    """The engine thread's per-token reports of ``sequences``, delivered into this event loop.

    Install before submitting: it sets each sequence's ``on_token`` and watches its ``done``.
    """

    def __init__(self, sequences: list[EngineSequence]) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Progress] = asyncio.Queue()
        for index, sequence in enumerate(sequences):
            sequence.on_token = functools.partial(self._token, index)
            sequence.done.add_done_callback(functools.partial(self._done, index))

    def _token(self, index: int, sequence: EngineSequence) -> None:  # on the engine thread
        text = sequence.text.text if sequence.text is not None else ""
        self._post(Progress(index, len(sequence.output), text))

    def _done(self, index: int, _: Future) -> None:  # on the engine thread, after the last token
        self._post(Progress(index, None))

    def _post(self, progress: Progress) -> None:
        # RuntimeError: the event loop has closed (the server is stopping), nobody listens.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, progress)

    async def next(self) -> list[Progress]:
        """What arrived since the last call (waiting for one): per choice its latest state, and
        an end after the last token it reported."""
        arrived = [await self.queue.get()]
        while not self.queue.empty():
            arrived.append(self.queue.get_nowait())
        latest: dict[int, Progress] = {}
        ends: list[Progress] = []
        for progress in arrived:
            if progress.tokens is None:
                ends.append(progress)
            else:
                latest[progress.index] = progress
        return [*latest.values(), *ends]


@dataclass
class ChoiceState:
    """What has been sent of one choice: its text, and how many of its tokens."""

    sequence: EngineSequence
    stops: tuple[str, ...]
    tool_calls: bool  # whether its reply is parsed for tool calls
    sent_text: str = ""
    sent_tokens: int = 0
    sent_offset: int = 0  # completions' text_offset of the next token (the token texts sent so far)
    finished: bool = False

    def sendable(self, text: str) -> str:
        """The new text that may go now: what no later token can change."""
        visible = text[: len(text) - unsent_stop_prefix(text, self.stops)]
        if self.tool_calls:
            start = visible.find(TOOL_CALL_START)
            if start >= 0:
                visible = visible[:start]
            else:
                visible = visible[: len(visible) - unsent_stop_prefix(visible, (TOOL_CALL_START,))]
            if not visible.strip():  # a reply of only tool calls has no content: send none yet
                visible = ""
        if len(visible) <= len(self.sent_text) or not visible.startswith(self.sent_text):
            return ""
        return visible[len(self.sent_text) :]


@dataclass
class StreamContext:
    """What a stream needs of its request and of the server."""

    model: str
    prompt: list[int]
    sequences: list[EngineSequence]
    token_text: TokenText
    decode: Callable[[Sequence[int]], str]
    include_usage: bool
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    return_token_ids: bool = False
    tool_calls: bool = False
    parallel_tool_calls: bool = True
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def usage(self) -> UsageInfo:
        completion_tokens = sum(len(sequence.output) for sequence in self.sequences)
        return UsageInfo(
            prompt_tokens=len(self.prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(self.prompt) + completion_tokens,
        )


def event(payload: dict[str, Any]) -> str:
    return f"data: {dumps_json(payload).decode()}\n\n"


async def _progress_events(
    context: StreamContext,
    progress: ProgressQueue,
    opening: Callable[[int, ChoiceState], str | None],
    piece: Callable[[int, ChoiceState, str, int], str],
    ending: Callable[[int, ChoiceState], str],
    usage: Callable[[], str],
) -> AsyncIterator[str]:
    """The route-independent loop: open each choice, send its pieces as they come, end it."""
    states = [ChoiceState(sequence, context.stops, context.tool_calls) for sequence in context.sequences]
    for index, state in enumerate(states):
        first = opening(index, state)
        if first is not None:
            yield first
    remaining = len(states)
    while remaining:
        for report in await progress.next():
            state = states[report.index]
            if state.finished:
                continue
            if report.tokens is None:
                state.finished = True
                remaining -= 1
                yield ending(report.index, state)
                continue
            text = state.sendable(report.text)
            if text:
                yield piece(report.index, state, text, report.tokens)
    if context.include_usage:
        yield usage()
    yield DONE


def _error_event(sequence: EngineSequence) -> str | None:
    """An event for a sequence the engine failed (the stream had begun: no status code can say it)."""
    error = sequence.done.exception()
    if error is None:
        return None
    message = f"the engine failed while generating ({type(error).__name__}); see the server log"
    return event({"error": {"code": "engine_error", "message": message}})


def chat_events(context: StreamContext, progress: ProgressQueue) -> AsyncIterator[str]:
    """A chat completion as ``chat.completion.chunk`` events (see the module docstring)."""

    def chunk(index: int, delta: DeltaMessage, **fields: Any) -> str:
        choice = ChatCompletionStreamChoice(index=index, delta=delta, **fields)
        return _chunk(ChatCompletionChunk, context, [choice])

    def opening(index: int, _: ChoiceState) -> str:
        return chunk(index, DeltaMessage(role="assistant", content=""))

    def piece(index: int, state: ChoiceState, text: str, tokens: int) -> str:
        logprobs = _chat_logprobs(context, state, tokens)
        state.sent_text += text
        return chunk(index, DeltaMessage(content=text), logprobs=logprobs)

    def ending(index: int, state: ChoiceState) -> str:
        sequence = state.sequence
        failed = _error_event(sequence)
        if failed is not None:
            return failed
        text = final_text(sequence, context.decode)
        reason = finish_reason(sequence)
        delta = DeltaMessage(content=_rest(text, state.sent_text))
        if state.tool_calls:
            reply = parse_tool_calls(text, context.parallel_tool_calls)
            if reply.tool_calls:
                reason = "tool_calls"
                delta = DeltaMessage(
                    content=_rest(reply.content or "", state.sent_text),
                    tool_calls=[
                        DeltaToolCall(
                            index=position,
                            id=call.id,
                            type="function",
                            function=DeltaFunctionCall(
                                name=call.function.name, arguments=call.function.arguments
                            ),
                        )
                        for position, call in enumerate(reply.tool_calls)
                    ],
                )
        logprobs = _chat_logprobs(context, state, len(sequence.output))
        stop_reason = None if reason == "tool_calls" else sequence.stop_reason
        return chunk(index, delta, logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason)

    def usage() -> str:
        return _chunk(ChatCompletionChunk, context, [], usage=context.usage())

    return _progress_events(context, progress, opening, piece, ending, usage)


def completion_events(context: StreamContext, progress: ProgressQueue) -> AsyncIterator[str]:
    """A completion as vLLM streams it: ``text_completion`` chunks (see the module docstring)."""

    def chunk(index: int, state: ChoiceState, text: str, tokens: int, **fields: Any) -> str:
        sequence = state.sequence
        start = state.sent_tokens
        logprobs = None
        if context.logprobs and tokens > start:
            logprobs = completion_logprobs(sequence, start, tokens, context.token_text, state.sent_offset)
            state.sent_offset += sum(len(token) for token in logprobs.tokens)
        choice = CompletionStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            token_ids=sequence.output[start:tokens] if context.return_token_ids else None,
            prompt_token_ids=context.prompt if context.return_token_ids and start == 0 else None,
            **fields,
        )
        state.sent_tokens = tokens
        state.sent_text += text
        return _chunk(CompletionStreamResponse, context, [choice])

    def piece(index: int, state: ChoiceState, text: str, tokens: int) -> str:
        return chunk(index, state, text, tokens)

    def ending(index: int, state: ChoiceState) -> str:
        sequence = state.sequence
        failed = _error_event(sequence)
        if failed is not None:
            return failed
        text = _rest(final_text(sequence, context.decode), state.sent_text) or ""
        return chunk(
            index,
            state,
            text,
            len(sequence.output),
            finish_reason=finish_reason(sequence),
            stop_reason=sequence.stop_reason,
        )

    def usage() -> str:
        return _chunk(CompletionStreamResponse, context, [], usage=context.usage())

    return _progress_events(context, progress, lambda index, state: None, piece, ending, usage)


def _chunk(model: type, context: StreamContext, choices: list[Any], usage: UsageInfo | None = None) -> str:
    payload = model(id=context.id, created=context.created, model=context.model, choices=choices, usage=usage)
    body = payload.model_dump(mode="json")
    if not context.include_usage:
        body.pop("usage")  # OpenAI sends usage: null on every chunk only when usage was asked for
    return event(body)


def _chat_logprobs(context: StreamContext, state: ChoiceState, tokens: int) -> Any:
    """The chat log-probs of the tokens since the last chunk (None unless asked); marks them sent."""
    start, state.sent_tokens = state.sent_tokens, tokens
    if not context.logprobs or tokens == start:
        return None
    return chat_logprobs(state.sequence, start, tokens, context.token_text)


def _rest(text: str, sent: str) -> str | None:
    """What of ``text`` is not sent yet (None if nothing): it extends what was sent."""
    rest = text[len(sent) :] if text.startswith(sent) else ""
    return rest or None


def new_stream_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
