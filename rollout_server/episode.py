"""The episode loop: one rollout job played between a policy and an env server.

:func:`play_episode` is the one loop (env create/step/close, the instruction, turn bookkeeping,
reply parsing with :func:`play_reply`, timings, truncation, env errors); what differs between
policies is an :class:`EpisodeBackend`:

* :class:`TokenContext` (:func:`run_episode`, training): a trainable engine that sees token ids
  only. The worker owns the tokenizer and the chat template, and the context grows turn by turn,
  never re-tokenised: the first prompt is the env instruction and the first observation as one
  user message under the chat template with its generation prompt; each reply is appended as
  exactly the token ids the engine sampled (loss mask 1, with the engine's behaviour log-probs);
  each next observation as only the template's text *after* the conversation so far (closing
  the assistant turn if the reply did not end with the end-of-turn token, the new user message,
  the generation prompt), tokenised alone (loss mask 0, log-prob 0.0). With the job's
  ``history_turns`` a prompt keeps only that many earlier turns: past the window each turn's
  prompt is rebuilt from the kept turns (the instruction before the oldest kept observation, the
  kept replies as the ids they were sampled as) and starts a new sequence (``segments``).
* the chat messages of a hosted model (:mod:`rollout_server.openai_chat`, evaluation).

An episode ends with ``truncated=True`` when ``max_turns`` is reached before the env finished,
or when the context has no room for another reply (a reply is given at most the room that is
left). Either way the env's next observation is still appended, as a next turn would have
appended it: a truncated trajectory's tokens after its last sampled token are the state it was
cut in, from which the trainer bootstraps the value; they never go to the engine. The env
instance is always closed. Env failures raise :class:`EpisodeEnvError` (the worker retries the
episode); engine failures raise the engine client's typed errors (a 429 is backed off inside
the client, never here).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_server.actions import (
    ParsedReply,
    env_action,
    format_instruction,
    parse_reply,
    plain_stop_token_ids,
)
from services.engine_client import EngineClient, EngineContextLengthError
from services.env_client import EnvClient, EnvClientError
from services.rollout_protocol import ActionFormat, RolloutJob, SamplingParams, Trajectory, Turn

logger = logging.getLogger(__name__)

DEFAULT_WORKER_ID = "local"
INSTRUCTION_SEPARATOR = "\n\n"
_PROBE_USER = "\x01stargym user probe\x01"
_PROBE_ASSISTANT = "\x01stargym assistant probe\x01"
REMEMBERED_TEXTS = 4096
"""Prompts and observations a :class:`ChatFormat` keeps the ids of (a few hundred KB)."""


class EpisodeEnvError(Exception):
    """The env server failed the episode (create or step); the cause is chained. Retry the episode."""

    def __init__(
        self, message: str, *, stage: str, turn: int | None = None, instance_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.turn = turn
        self.instance_id = instance_id


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended turn by turn (see :class:`ChatFormat`)."""


class ChatFormat:
    """The chat template cut into the pieces an incremental context needs.

    Rendering a probe conversation tells what the template puts after an assistant message's
    content (``assistant_end``, e.g. ``<|im_end|>\\n``) and what a following user message adds
    (everything after the conversation so far, generation prompt included). Templates that
    rewrite earlier turns when a new one comes cannot be extended and raise
    :class:`ChatTemplateError`.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        user = {"role": "user", "content": _PROBE_USER}
        assistant = {"role": "assistant", "content": _PROBE_ASSISTANT}
        prompt = self.render([user], generation_prompt=True)
        answered = self.render([user, assistant])
        if not answered.startswith(prompt + _PROBE_ASSISTANT):
            raise ChatTemplateError(
                "the chat template does not render an assistant reply right after the generation prompt"
            )
        self.assistant_end = answered[len(prompt) + len(_PROBE_ASSISTANT) :]
        self._answered = answered
        self._answered_user = [user, assistant]
        followed = self.render(
            [user, assistant, {"role": "user", "content": _PROBE_USER}], generation_prompt=True
        )
        if not followed.startswith(answered):
            raise ChatTemplateError("the chat template rewrites earlier turns when a user message follows")
        # Rendering the template and tokenising was a quarter of the rollout worker's CPU (py-spy,
        # the demo's second stage), and most of it repeats: a group's episodes share their first
        # prompt and revisit the same observations (a FrozenLake map has 16 tiles).
        self._first_prompt = functools.lru_cache(maxsize=REMEMBERED_TEXTS)(self._encode_first_prompt)
        self._next_user = functools.lru_cache(maxsize=REMEMBERED_TEXTS)(self._encode_next_user)
        # Tokenising every spelling of every action at each episode's start was 4.3% of the worker's
        # samples (py-spy, the demo's 8-turn stage); an env's action list seldom changes.
        self._plain_stops = functools.lru_cache(maxsize=REMEMBERED_TEXTS)(self._encode_plain_stops)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text of ``messages`` (and ``tools``, for templates that render them)."""
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        """Template text to ids; the text already holds its special tokens, so none are added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, content: str) -> list[int]:
        """The first user message under the template, generation prompt included."""
        return list(self._first_prompt(content))

    def next_user_text(self, content: str) -> str:
        """What the template adds after an assistant turn for a new user message + generation prompt."""
        messages = [*self._answered_user, {"role": "user", "content": content}]
        text = self.render(messages, generation_prompt=True)
        if not text.startswith(self._answered):
            raise ChatTemplateError("the chat template rewrites earlier turns when a user message follows")
        return text[len(self._answered) :]

    def closing_text(self, reply_ids: Sequence[int]) -> str:
        """What closes the assistant turn after ``reply_ids``: nothing of what the model sampled.

        A reply that ended with the end-of-turn token (a special token that ``assistant_end``
        starts with) keeps it, and only the rest of ``assistant_end`` is added.
        """
        if reply_ids and int(reply_ids[-1]) in self.special_ids:
            last = self.tokenizer.decode([int(reply_ids[-1])], skip_special_tokens=False)
            if last and self.assistant_end.startswith(last):
                return self.assistant_end[len(last) :]
        return self.assistant_end

    def next_user(self, reply_ids: Sequence[int], content: str) -> list[int]:
        """Ids to append after a reply so that the model answers ``content`` next."""
        return list(self._next_user(self.closing_text(reply_ids), content))

    def plain_stops(self, actions: Sequence[str] | None) -> list[int]:
        """:func:`~rollout_server.actions.plain_stop_token_ids` of ``actions`` with this tokenizer."""
        return list(self._plain_stops(tuple(actions or ())))

    def _encode_plain_stops(self, actions: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(plain_stop_token_ids(self.tokenizer, actions))

    def _encode_first_prompt(self, content: str) -> tuple[int, ...]:
        return tuple(self.encode(self.render([{"role": "user", "content": content}], generation_prompt=True)))

    def _encode_next_user(self, closing: str, content: str) -> tuple[int, ...]:
        return tuple(self.encode(closing + self.next_user_text(content)))


_CHAT_FORMATS: dict[int, tuple[Any, ChatFormat]] = {}


def chat_format(tokenizer: Any) -> ChatFormat:
    """The :class:`ChatFormat` of ``tokenizer``, built once per tokenizer object."""
    cached = _CHAT_FORMATS.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        cached = _CHAT_FORMATS[id(tokenizer)] = (tokenizer, ChatFormat(tokenizer))
    return cached[1]


@dataclass(frozen=True, slots=True)
class Reply:
    """One policy reply as the loop sees it: its text and the token counts of the turn."""

    text: str
    prompt_tokens: int
    """Tokens added before the reply (the observation under the template); the API's count for chat."""
    response_tokens: int
    busy_wait_s: float = 0.0
    """Seconds the policy's client spent waiting out 429s for this reply."""


AvailableActions = Callable[[], Awaitable[list[str] | None]]
"""The env instance's available actions (timed, env errors raised as :class:`EpisodeEnvError`)."""


class EpisodeBackend(Protocol):
    """What the loop needs of a policy: the context it keeps, and what the trajectory records."""

    policy_version: int
    """The weights every turn is tagged with."""

    async def start(
        self,
        instruction: str,
        observation: str,
        action_format: ActionFormat,
        max_actions: int,
        available_actions: AvailableActions,
    ) -> bool:
        """Begin the context with the first user message (:func:`first_message`); False when not
        even one reply fits."""
        ...

    async def reply(self, sampling: SamplingParams, seed: int | None) -> Reply:
        """The policy's next reply (EngineContextLengthError: the context is full)."""
        ...

    def observe(self, observation: str, *, last: bool) -> bool:
        """Append the next observation after the last reply; False when no reply fits after it.

        It is appended either way: a truncated episode ends in the state it was cut in. ``last``:
        no reply will follow (``max_turns`` is reached), so the observation is only that state.
        """
        ...

    def trajectory_fields(self) -> dict[str, Any]:
        """What the trajectory records of the context (token fields, or ``text_only``)."""
        ...


def first_message(instruction: str, observation: str) -> str:
    """The first user message of a prompt: the instruction, then the observation."""
    return f"{instruction}{INSTRUCTION_SEPARATOR}{observation}" if instruction else observation


def first_kept_turn(completed_turns: int, history_turns: int | None) -> int:
    """The oldest turn a prompt keeps once ``completed_turns`` turns were played (``history_turns``
    earlier turns before the current observation; None keeps them all)."""
    return 0 if history_turns is None else max(0, completed_turns - history_turns)


async def play_episode(
    job: RolloutJob,
    envs: EnvClient,
    backend: EpisodeBackend,
    env_spec_instruction: str,
    *,
    worker_id: str = DEFAULT_WORKER_ID,
    default_action_format: ActionFormat = "plain",
) -> Trajectory:
    """Play ``job`` to the end with ``backend``'s policy and return its trajectory.

    ``job.sampling`` is used for every turn (``seed + turn`` as each turn's seed when a seed is
    set); ``job.options`` go to the env (``max_actions_per_turn`` among them, which
    ``answer_tags`` honours too). The env instruction (``GET /envs``) and the action format's
    own instruction come before the first observation.
    """
    started = time.perf_counter()
    timings = {"env_s": 0.0, "generate_s": 0.0, "busy_wait_s": 0.0}
    action_format: ActionFormat = job.action_format or default_action_format
    max_actions = int((job.options or {}).get("max_actions_per_turn", 1))
    instruction = env_spec_instruction
    extra = format_instruction(action_format, max_actions)
    if extra:
        instruction = f"{instruction}{INSTRUCTION_SEPARATOR}{extra}" if instruction else extra

    clock = time.perf_counter()
    try:
        created = await envs.create(job.env, seed=job.seed, options=job.options)
    except EnvClientError as exc:
        raise EpisodeEnvError(f"{job.env}: create failed: {exc}", stage="create") from exc
    finally:
        timings["env_s"] += time.perf_counter() - clock
    instance_id = created.instance_id

    async def available_actions() -> list[str] | None:
        clock = time.perf_counter()
        try:
            return await envs.available_actions(instance_id)
        except EnvClientError as exc:
            raise EpisodeEnvError(
                f"{job.env}: available_actions failed: {exc}",
                stage="available_actions",
                instance_id=instance_id,
            ) from exc
        finally:
            timings["env_s"] += time.perf_counter() - clock

    turns: list[Turn] = []
    truncated = False
    success = False
    observation = created.observation
    try:
        truncated = not await backend.start(
            instruction, observation, action_format, max_actions, available_actions
        )
        for turn_index in range(0 if truncated else job.max_turns):
            seed = None if job.sampling.seed is None else job.sampling.seed + turn_index
            clock = time.perf_counter()
            try:
                reply = await backend.reply(job.sampling, seed)
            except EngineContextLengthError:
                truncated = True  # the engine's own limit is below ours: the same outcome
                break
            finally:
                timings["generate_s"] += time.perf_counter() - clock
            timings["busy_wait_s"] += reply.busy_wait_s
            parsed, outcome = await play_reply(
                job,
                envs,
                instance_id,
                turn_index,
                reply.text,
                action_format,
                max_actions,
                observation,
                timings,
            )
            success = outcome.success if outcome.success is not None else success
            turns.append(
                Turn(
                    observation=observation,
                    response=reply.text,
                    actions=parsed.actions,
                    reward=outcome.reward,
                    done=outcome.done,
                    valid=outcome.valid,
                    invalid_actions=outcome.invalid_actions,
                    policy_version=backend.policy_version,
                    prompt_tokens=reply.prompt_tokens,
                    response_tokens=reply.response_tokens,
                )
            )
            if outcome.done:
                break
            observation = outcome.observation
            last = turn_index == job.max_turns - 1
            room = backend.observe(observation, last=last)
            if not room or last:
                truncated = True  # the context is full, or max_turns came before the env finished
                break
    finally:
        clock = time.perf_counter()
        try:
            await envs.close(instance_id)
        except EnvClientError as exc:  # the server's TTL reclaims it; the episode itself is sound
            logger.warning("closing env instance %s failed: %s", instance_id, exc)
        timings["env_s"] += time.perf_counter() - clock

    timings["total_s"] = time.perf_counter() - started
    return Trajectory.from_job(
        job,
        policy_version=backend.policy_version,
        turns=turns,
        reward=sum(turn.reward for turn in turns),
        success=success,
        num_turns=len(turns),
        truncated=truncated,
        timings=timings,
        worker_id=worker_id,
        **backend.trajectory_fields(),
    )


@dataclass
class TokenContext:
    """The backend of a trainable engine: the episode as token ids, one growing sequence or, past a
    ``history_turns`` window, one sequence per turn.

    ``token_ids``, ``loss_mask`` and ``logprobs`` stay aligned (see the module docstring); the
    engine is sent the current sequence only, ``token_ids[segments[-1]:]``.
    """

    engine: EngineClient
    tokenizer: Any
    policy_version: int
    max_model_len: int | None = None
    """The context limit in tokens (prompt and replies); None: only the engine's."""
    stop_token_ids: Sequence[int] | None = None
    """For the plain format; None computes them from the env's available actions."""
    history_turns: int | None = None
    """Earlier turns each prompt keeps (:attr:`~services.rollout_protocol.JobFields.history_turns`)."""
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    _stops: list[int] = field(default_factory=list)
    _pending_prompt: int = 0
    _instruction: str = ""
    _observations: list[str] = field(default_factory=list)
    _replies: list[list[int]] = field(default_factory=list)
    _sequence_turn: int = 0
    """The turn whose observation the current sequence's first message holds."""

    def __post_init__(self) -> None:
        self.chat = chat_format(self.tokenizer)

    async def start(
        self,
        instruction: str,
        observation: str,
        action_format: ActionFormat,
        max_actions: int,
        available_actions: AvailableActions,
    ) -> bool:
        if action_format == "plain" and max_actions == 1:
            # Stopping at a whole action: several actions per reply must not stop at the first.
            if self.stop_token_ids is None:
                self._stops = self.chat.plain_stops(await available_actions())
            else:
                self._stops = list(self.stop_token_ids)
        self._instruction = instruction
        self._observations.append(observation)
        self._add_prompt(self.chat.first_prompt(first_message(instruction, observation)))
        return self._has_room()

    async def reply(self, sampling: SamplingParams, seed: int | None) -> Reply:
        context = self.token_ids[self._sequence_start :]
        max_tokens = sampling.max_tokens
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - len(context))
        completion = await self.engine.complete(
            context, sampling, self._stops, max_tokens=max_tokens, seed=seed
        )
        self.token_ids += completion.token_ids
        self.loss_mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self._replies.append(list(completion.token_ids))
        return Reply(
            text=self.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
            prompt_tokens=self._pending_prompt,
            response_tokens=len(completion.token_ids),
            busy_wait_s=completion.busy_wait_s,
        )

    def observe(self, observation: str, *, last: bool) -> bool:
        self._observations.append(observation)
        first = first_kept_turn(len(self._replies), self.history_turns)
        if first != self._sequence_turn and not last:
            prompt = self._window_prompt(first)
            if self.max_model_len is None or len(prompt) < self.max_model_len:
                self.segments.append(len(self.token_ids))
                self._sequence_turn = first
                self._add_prompt(prompt)
                return True
        # The window still holds the whole sequence, or no reply follows (or fits) a new one: the
        # state the episode ends in goes after the last reply, which keeps every sequence trainable.
        self._add_prompt(self.chat.next_user(self._replies[-1], observation))
        return self._has_room()

    def trajectory_fields(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "segments": self.segments,
        }

    @property
    def _sequence_start(self) -> int:
        return self.segments[-1] if self.segments else 0

    def _has_room(self) -> bool:
        return self.max_model_len is None or len(self.token_ids) - self._sequence_start < self.max_model_len

    def _window_prompt(self, first: int) -> list[int]:
        """The prompt of turns ``first``.. as one new sequence: the kept replies as the ids they were
        sampled as (never re-tokenised text), each followed by the observation that answered it."""
        ids = self.chat.first_prompt(first_message(self._instruction, self._observations[first]))
        for reply, observation in zip(self._replies[first:], self._observations[first + 1 :], strict=True):
            ids += reply
            ids += self.chat.next_user(reply, observation)
        return ids

    def _add_prompt(self, ids: Sequence[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self._pending_prompt = len(ids)


async def run_episode(
    job: RolloutJob,
    envs: EnvClient,
    engine: EngineClient,
    tokenizer: Any,
    env_spec_instruction: str,
    policy_version: int,
    *,
    max_model_len: int | None = None,
    worker_id: str = DEFAULT_WORKER_ID,
    default_action_format: ActionFormat = "plain",
    stop_token_ids: Sequence[int] | None = None,
) -> Trajectory:
    """Play ``job`` on a trainable engine (:class:`TokenContext`) and return its trajectory.

    Args:
        job, envs, env_spec_instruction, worker_id, default_action_format: see :func:`play_episode`.
        engine: an open client; ``tokenizer``: the served model's, chat template included.
        policy_version: the weights the engine serves; every turn is tagged with it.
        max_model_len: the context limit in tokens (prompt and replies); None: only the engine's.
        stop_token_ids: for the plain format; None computes them from the env's available actions
            (single-action turns only: several actions per reply must not stop at the first).
    """
    backend = TokenContext(
        engine, tokenizer, policy_version, max_model_len, stop_token_ids, job.history_turns
    )
    return await play_episode(
        job,
        envs,
        backend,
        env_spec_instruction,
        worker_id=worker_id,
        default_action_format=default_action_format,
    )


@dataclass(frozen=True, slots=True)
class ReplyOutcome:
    """What one reply did in the env: the format penalty plus the step's result, if it stepped."""

    reward: float
    done: bool
    valid: bool
    invalid_actions: int  # of the actions sent (Turn.invalid_actions)
    observation: str
    success: bool | None  # the env's verdict when it gave one, else None


async def play_reply(
    job: RolloutJob,
    envs: EnvClient,
    instance_id: str,
    turn_index: int,
    response: str,
    action_format: ActionFormat,
    max_actions: int,
    observation: str,
    timings: dict[str, float],
) -> tuple[ParsedReply, ReplyOutcome]:
    """Parse a reply and carry its action out; a reply with no action costs the format penalty.

    The one place a reply is scored, for every backend of :func:`play_episode`.
    """
    parsed = parse_reply(response, action_format, max_actions)
    action = env_action(parsed)
    if action is None:
        return parsed, ReplyOutcome(parsed.penalty, False, False, 0, observation, None)
    clock = time.perf_counter()
    try:
        step = await envs.step(instance_id, action)
    except EnvClientError as exc:
        raise EpisodeEnvError(
            f"{job.env}: step {turn_index} failed: {exc}",
            stage="step",
            turn=turn_index,
            instance_id=instance_id,
        ) from exc
    finally:
        timings["env_s"] += time.perf_counter() - clock
    valid = bool(step.info.get("valid", True)) and parsed.format_ok
    # The env host counts a multi-action reply's rejected actions; one action is all or nothing.
    # Bounded by what was sent, so an env whose own info uses the key cannot void the trajectory.
    invalid_actions = 0 if valid else min(int(step.info.get("invalid_actions", 1)), len(parsed.actions))
    success = step.info.get("success")
    return parsed, ReplyOutcome(
        parsed.penalty + step.reward,
        step.done,
        valid,
        invalid_actions,
        step.observation,
        None if success is None else bool(success),
    )
