"""One agent episode's recording chat session: OpenAI's chat route in, exact token ids recorded.

An agent written against the OpenAI client talks to ``/sessions/{id}/v1`` on the rollout worker
(:mod:`rollout_server.proxy`); each of its chat calls comes here. The session renders the
messages with the policy's chat template, sends token ids to the engine's ``/v1/completions``
and keeps, as a training episode does (:class:`rollout_server.episode.TokenContext`), one
growing list of token ids with its loss mask and behaviour log-probs:

* **a call that extends the last one** (its messages are the last call's, then the reply it got,
  then new messages) appends only what is new: the template's closing of the assistant turn
  after the ids the engine sampled (:meth:`~rollout_server.episode.ChatFormat.closing_text`),
  then the template's text after the conversation so far, tokenised alone (mask 0). The reply
  stays exactly the sampled ids, never re-tokenised from the text the agent sent back; the
  agent may send it back as it likes (the SDK's message object, or its own dict with the same
  role, text and tool calls).
* **a call that does not** (the agent dropped, summarised or edited earlier turns, or changed its
  tools) starts a new *segment*: its whole prompt is tokenised and appended (mask 0), and the
  index where it starts is recorded (``Trajectory.segments``). The trainer trains each segment
  as its own sequence, since the model never saw the earlier one before it.

Sampling is the run's, not the agent's: ``temperature``, ``top_p``, ``top_k`` and the seed come
from the job (the seed advances per call, as per turn in an env episode), because the trainer's
PPO ratio is against the distribution the behaviour log-probs were drawn from, and a random
policy must explore as configured. An agent's own values of those fields, and penalties and
``logit_bias``, are accepted (OpenAI clients send them) and not applied. ``max_tokens`` is the
smaller of the agent's and the run's; ``stop`` strings and ``stop_token_ids`` are the agent's.
Tools go through the template and replies are parsed for Hermes/Qwen ``<tool_call>`` blocks, as
the engine's own chat route does; a call the model wrote badly is plain content, the agent's
problem, and recorded like any reply.

Calls are refused, with OpenAI-shaped 4xx errors and nothing recorded, past ``max_turns`` (the
horizon of the ScalingInter-RL schedule; the episode is then ``truncated``), past the context
(``max_model_len``; also truncated), with ``n`` > 1 (one reply per call, one trajectory), with
JSON ``response_format`` (no guided decoding), and while another call of the session is in
flight (calls must be sequential to extend each other).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_server.engine.chat import (
    ParsedReply,
    parse_tool_calls,
    parses_tool_calls,
    refuse_unsupported,
    template_messages,
    template_tools,
)
from rollout_server.episode import ChatFormat, chat_format
from services.agent_protocol import HarnessCall, SessionFinish
from services.engine_client import Completion, EngineClient, EngineClientError, EngineContextLengthError
from services.engine_protocol import (
    ChatCompletionChoice,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatResponseMessage,
    UsageInfo,
)
from services.errors import ApiError, bad_request, conflict, not_found
from services.rollout_protocol import RolloutJob, Turn

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's code for a prompt past the context, which agents' retry logic knows."""
TURN_LIMIT = "turn_limit_reached"


@dataclass
class SessionRecord:
    """What a session has recorded: the token-level fields of a trajectory and its turns."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False
    """A call was refused for the turn limit or the context: the agent could not go on."""
    generate_s: float = 0.0
    busy_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Conversation:
    """The last call's messages and tools, with the reply it got, as the template sees them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply_ids: list[int]


class RecordingSession:
    """The chat calls of one episode, recorded as one token context (see the module docstring).

    Args:
        session_id: the ``{id}`` of its routes.
        job: the episode's job: its sampling, ``max_turns`` and policy version.
        engine: an open client of the engine to sample from.
        tokenizer: the policy's, chat template included.
        policy_version: the weights the engine serves; every turn is tagged with it.
        model_name: what ``/v1/models`` and the replies call the model.
        max_model_len: the context limit of a segment; None: only the engine's.
    """

    def __init__(
        self,
        session_id: str,
        job: RolloutJob,
        engine: EngineClient,
        tokenizer: Any,
        policy_version: int,
        model_name: str,
        max_model_len: int | None = None,
    ) -> None:
        self.session_id = session_id
        self.job = job
        self.engine = engine
        self.chat: ChatFormat = chat_format(tokenizer)
        self.policy_version = policy_version
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.record = SessionRecord()
        self._last: _Conversation | None = None
        self._segment_start = 0
        self._lock = asyncio.Lock()
        self.engine_error: EngineClientError | None = None
        """The engine failure behind a call the agent got a 502 for: the worker reruns the episode."""

    @property
    def turns_left(self) -> int:
        return self.job.max_turns - len(self.record.turns)

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Answer one chat call and record it; an :class:`ApiError` (4xx) records nothing."""
        if self._lock.locked():
            raise conflict(
                "call_in_flight",
                f"session {self.session_id} is answering another call: an agent's calls must be "
                "sequential, each extending the last",
            )
        async with self._lock:
            return await self._complete(request)

    async def _complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        _check(request)
        if self.turns_left <= 0:
            self.record.truncated = True
            raise bad_request(
                TURN_LIMIT,
                f"the episode's turn limit ({self.job.max_turns}) is reached: no more calls in this session",
            )
        messages = template_messages(request)
        tools = template_tools(request)
        prompt_ids, new_segment = self._prompt(messages, tools)
        context = self.record.token_ids[self._segment_start :] if not new_segment else []
        context_len = len(context) + len(prompt_ids)
        room = None if self.max_model_len is None else self.max_model_len - context_len
        if room is not None and room <= 0:
            self.record.truncated = True
            raise ApiError(
                400,
                CONTEXT_LENGTH_EXCEEDED,
                f"this call's context is {context_len} tokens; the model's maximum is {self.max_model_len}",
            )
        limits = [value for value in (request.max_tokens, request.max_completion_tokens) if value is not None]
        max_tokens = min([self.job.sampling.max_tokens, *limits, *([room] if room is not None else [])])
        sampling = self.job.sampling
        seed = None if sampling.seed is None else sampling.seed + len(self.record.turns)
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        started = time.perf_counter()
        try:
            completion = await self.engine.complete(
                [*context, *prompt_ids],
                sampling,
                request.stop_token_ids,
                max_tokens=max_tokens,
                seed=seed,
                stop=stop,
                top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0,
            )
        except EngineContextLengthError as exc:
            self.record.truncated = True
            raise ApiError(400, CONTEXT_LENGTH_EXCEEDED, str(exc)) from None
        except EngineClientError as exc:
            self.engine_error = exc
            raise ApiError(502, "engine_error", f"the policy's engine failed this call: {exc}") from None
        finally:
            self.record.generate_s += time.perf_counter() - started
        self.record.busy_wait_s += completion.busy_wait_s
        reply = ParsedReply(content=completion.text)
        if parses_tool_calls(request):
            reply = parse_tool_calls(completion.text, request.parallel_tool_calls is not False)
        self._append(prompt_ids, new_segment, completion, messages, reply)
        reply_message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
        if reply.tool_calls:
            reply_message["tool_calls"] = [
                {"name": call.function.name, "arguments": call.function.arguments}
                for call in reply.tool_calls
            ]
        self._last = _Conversation([*messages, reply_message], tools, completion.token_ids)
        return ChatCompletionResponse(
            model=self.model_name,
            choices=[
                ChatCompletionChoice(
                    index=0,
                    message=ChatResponseMessage(content=reply.content, tool_calls=reply.tool_calls),
                    logprobs=_logprobs(completion, request.top_logprobs or 0) if request.logprobs else None,
                    finish_reason="tool_calls" if reply.tool_calls else completion.finish_reason,
                    stop_reason=None if reply.tool_calls else completion.stop_reason,
                )
            ],
            usage=UsageInfo(
                prompt_tokens=context_len,
                completion_tokens=len(completion.token_ids),
                total_tokens=context_len + len(completion.token_ids),
            ),
        )

    def _prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], bool]:
        """The ids to append before sampling, and whether they start a new segment."""
        try:
            text = self.chat.render(messages, generation_prompt=True, tools=tools)
            last = self._last
            if last is not None and tools == last.tools and _extends(messages, last.messages):
                # The agent's own rendering of the history it sent back: its reply may differ in
                # form (ids, whitespace) from what was sampled; only what follows it is new.
                history = self.chat.render(messages[: len(last.messages)], tools=tools)
                if text.startswith(history):
                    closing = self.chat.closing_text(last.reply_ids)
                    return self.chat.encode(closing + text[len(history) :]), False
        except Exception as exc:  # no template, or one that refuses these roles (jinja raises)
            raise bad_request(
                "chat_template", f"the model's chat template cannot render these messages: {exc}"
            ) from None
        return self.chat.encode(text), True

    def _append(
        self,
        prompt_ids: Sequence[int],
        new_segment: bool,
        completion: Completion,
        messages: list[dict[str, Any]],
        reply: ParsedReply,
    ) -> None:
        record = self.record
        if new_segment:
            if record.token_ids:
                record.segments.append(len(record.token_ids))
            self._segment_start = len(record.token_ids)
        record.token_ids += [*prompt_ids, *completion.token_ids]
        record.loss_mask += [0] * len(prompt_ids) + [1] * len(completion.token_ids)
        record.logprobs += [0.0] * len(prompt_ids) + list(completion.logprobs)
        record.turns.append(
            Turn(
                observation=_new_messages_text(messages, self._last, new_segment),
                response=completion.text,
                actions=[call.function.name for call in reply.tool_calls],
                reward=0.0,
                done=False,
                valid=not reply.malformed,
                policy_version=self.policy_version,
                prompt_tokens=len(prompt_ids),
                response_tokens=len(completion.token_ids),
            )
        )


def _check(request: ChatCompletionRequest) -> None:
    """What a recording session cannot do: one reply per call, and what the engine's routes refuse."""
    if request.n != 1:
        raise bad_request("one_choice_per_call", f"n={request.n}: a session records one reply per call")
    refuse_unsupported(request)


def _extends(messages: list[dict[str, Any]], previous: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` are ``previous`` (the last call's, then its reply) and then more."""
    if len(messages) <= len(previous):
        return False
    *earlier, reply = previous
    sent = messages[: len(previous)]
    return sent[:-1] == earlier and _same_reply(sent[-1], reply)


def _same_reply(sent: dict[str, Any], reply: dict[str, Any]) -> bool:
    """The agent's copy of a reply is the reply: same role, text (up to surrounding whitespace)
    and tool calls (name and arguments; the ids are the agent's business)."""
    calls = [
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
        for call in sent.get("tool_calls") or ()
    ]
    expected = [
        {"name": call["name"], "arguments": json.loads(call["arguments"])}
        for call in reply.get("tool_calls", ())
    ]
    return (
        sent.get("role") == "assistant"
        and (sent.get("content") or "").strip() == reply["content"].strip()
        and calls == expected
    )


def _new_messages_text(messages: list[dict[str, Any]], last: _Conversation | None, new_segment: bool) -> str:
    """The text of the messages this call added: what the model answered, for ``Turn.observation``."""
    start = 0 if new_segment or last is None else len(last.messages)
    return "\n".join(message["content"] for message in messages[start:])


def _logprobs(completion: Completion, top: int) -> ChatCompletionLogProbs:
    """OpenAI's ``logprobs.content`` of the sampled tokens, with up to ``top`` likely ones each."""
    content = []
    for position, (token, value) in enumerate(zip(completion.tokens, completion.logprobs, strict=False)):
        candidates = completion.top_logprobs[position] if position < len(completion.top_logprobs) else {}
        ranked = sorted(candidates.items(), key=lambda item: -item[1])[:top]
        content.append(
            ChatLogProbsContent(
                token=token,
                logprob=value,
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatLogProb(
                        token=text, logprob=logprob, bytes=list(text.encode("utf-8", errors="replace"))
                    )
                    for text, logprob in ranked
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


@dataclass
class _Open:
    session: RecordingSession
    finished: asyncio.Future[SessionFinish]


class SessionRegistry:
    """The worker's open sessions, by id: what the proxy routes look up and finish."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self._waiting: deque[HarnessCall] = deque()

    def add(self, session: RecordingSession) -> None:
        self._open[session.session_id] = _Open(session, asyncio.get_running_loop().create_future())

    def offer(self, call: HarnessCall) -> None:
        """Make the session of ``call`` one that a harness may take (:meth:`take`)."""
        self._waiting.append(call)

    def take(self) -> HarnessCall | None:
        """The oldest offered session still open; None if there is none."""
        while self._waiting:
            call = self._waiting.popleft()
            entry = self._open.get(call.session_id)
            if entry is not None and not entry.finished.done():
                return call  # else its episode ended (timed out, worker stopping) before a harness came
        return None

    def get(self, session_id: str) -> RecordingSession:
        """The open session ``session_id``; a 404 once it was closed or if it never was."""
        entry = self._open.get(session_id)
        if entry is None:
            raise not_found("session", session_id)
        if entry.finished.done():
            raise conflict("session_finished", f"session {session_id} is finished: it takes no more calls")
        return entry.session

    def finish(self, session_id: str, outcome: SessionFinish) -> RecordingSession:
        """End the session with ``outcome`` (a 409 if it was finished already)."""
        session = self.get(session_id)
        self._open[session_id].finished.set_result(outcome)
        return session

    async def finished(self, session_id: str, timeout_s: float) -> SessionFinish:
        """The outcome its harness reports; ``TimeoutError`` if none comes within ``timeout_s``."""
        return await asyncio.wait_for(asyncio.shield(self._open[session_id].finished), timeout_s)

    def close(self, session_id: str) -> None:
        """Forget the session: its routes answer 404 from now on."""
        entry = self._open.pop(session_id, None)
        if entry is not None and not entry.finished.done():
            entry.finished.cancel()
