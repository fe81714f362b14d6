"""The episode runner: one rollout job played between an inference engine and an env server.

The worker owns the tokenizer and the chat template; the engine only ever sees token ids. The
context grows turn by turn and is never re-tokenised:

* the first prompt is the env instruction and the first observation as one user message, under
  the chat template with its generation prompt;
* each reply is appended as exactly the token ids the engine sampled (loss mask 1, with the
  engine's behaviour log-probs);
* the next observation is appended as only the template's text *after* the conversation so far
  (closing the assistant turn if the reply did not end with the end-of-turn token, the new user
  message, the generation prompt), tokenised alone (loss mask 0, log-prob 0.0).

A context limit ends the episode with ``truncated=True`` (a reply is given at most the room that
is left; an observation that does not fit is not appended), as does ``max_turns`` when the env
has not finished. The env instance is always closed. Env failures raise :class:`EpisodeEnvError`
(the worker retries the episode); engine failures raise the engine client's typed errors, after
backing off on 429 for up to ``busy_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_server.actions import (
    ParsedReply,
    env_action,
    format_instruction,
    parse_reply,
    plain_stop_token_ids,
)
from services.engine_client import Completion, EngineBusyError, EngineClient, EngineContextLengthError
from services.env_client import EnvClient, EnvClientError
from services.rollout_protocol import ActionFormat, RolloutJob, Trajectory, Turn

logger = logging.getLogger(__name__)

DEFAULT_WORKER_ID = "local"
INSTRUCTION_SEPARATOR = "\n\n"
_PROBE_USER = "\x01stargym user probe\x01"
_PROBE_ASSISTANT = "\x01stargym assistant probe\x01"


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

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        """Template text to ids; the text already holds its special tokens, so none are added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, content: str) -> list[int]:
        """The first user message under the template, generation prompt included."""
        return self.encode(self.render([{"role": "user", "content": content}], generation_prompt=True))

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
        return self.encode(self.closing_text(reply_ids) + self.next_user_text(content))


_CHAT_FORMATS: dict[int, tuple[Any, ChatFormat]] = {}


def chat_format(tokenizer: Any) -> ChatFormat:
    """The :class:`ChatFormat` of ``tokenizer``, built once per tokenizer object."""
    cached = _CHAT_FORMATS.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        cached = _CHAT_FORMATS[id(tokenizer)] = (tokenizer, ChatFormat(tokenizer))
    return cached[1]


@dataclass
class _Context:
    """The growing episode context: three aligned lists."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]

    def add_prompt(self, ids: Sequence[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_reply(self, completion: Completion) -> None:
        self.token_ids += completion.token_ids
        self.loss_mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs


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
    busy_timeout_s: float = 60.0,
) -> Trajectory:
    """Play ``job`` to the end and return its trajectory.

    Args:
        job: what to play; ``job.sampling`` is used for every turn (``max_tokens`` per turn,
            ``seed + turn`` as each turn's seed when a seed is set); ``job.options`` go to the env
            (``max_actions_per_turn`` among them, which ``answer_tags`` honours too).
        envs, engine: open clients.
        tokenizer: the served model's tokenizer, chat template included.
        env_spec_instruction: the env's instruction (``GET /envs``), put before the first observation.
        policy_version: the weights the engine serves; every turn is tagged with it.
        max_model_len: the context limit in tokens (prompt and replies); None: only the engine's.
        worker_id: recorded in the trajectory.
        default_action_format: used when the job names none.
        stop_token_ids: for the plain format; None computes them from the env's available actions
            (single-action turns only: several actions per reply must not stop at the first).
        busy_timeout_s: how long to back off and retry while the engine answers 429.
    """
    started = time.perf_counter()
    timings = {"env_s": 0.0, "generate_s": 0.0, "busy_wait_s": 0.0}
    chat = chat_format(tokenizer)
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

    context = _Context([], [], [])
    turns: list[Turn] = []
    truncated = False
    success = False
    try:
        stops: list[int] = []
        if action_format == "plain" and max_actions == 1:
            if stop_token_ids is None:
                clock = time.perf_counter()
                try:
                    available = await envs.available_actions(instance_id)
                except EnvClientError as exc:
                    raise EpisodeEnvError(
                        f"{job.env}: available_actions failed: {exc}",
                        stage="available_actions",
                        instance_id=instance_id,
                    ) from exc
                finally:
                    timings["env_s"] += time.perf_counter() - clock
                stops = plain_stop_token_ids(tokenizer, available)
            else:
                stops = list(stop_token_ids)

        observation = created.observation
        content = f"{instruction}{INSTRUCTION_SEPARATOR}{observation}" if instruction else observation
        prompt = chat.first_prompt(content)
        if max_model_len is not None and len(prompt) >= max_model_len:
            # Not even the first reply fits: an empty episode, truncated.
            context.add_prompt(prompt)
            truncated = True
        else:
            context.add_prompt(prompt)
            pending_prompt = len(prompt)
            for turn_index in range(job.max_turns):
                max_tokens = job.sampling.max_tokens
                if max_model_len is not None:
                    max_tokens = min(max_tokens, max_model_len - len(context.token_ids))
                seed = None if job.sampling.seed is None else job.sampling.seed + turn_index
                clock = time.perf_counter()
                try:
                    completion = await _generate(
                        engine, context.token_ids, job, stops, max_tokens, seed, busy_timeout_s, timings
                    )
                except EngineContextLengthError:
                    # The engine's own limit is below ours: the same outcome, a truncated episode.
                    truncated = True
                    break
                finally:
                    timings["generate_s"] += time.perf_counter() - clock
                context.add_reply(completion)
                response = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                parsed, outcome = await play_reply(
                    job,
                    envs,
                    instance_id,
                    turn_index,
                    response,
                    action_format,
                    max_actions,
                    observation,
                    timings,
                )
                reward, done, valid, next_observation = (
                    outcome.reward,
                    outcome.done,
                    outcome.valid,
                    outcome.observation,
                )
                success = outcome.success if outcome.success is not None else success
                turns.append(
                    Turn(
                        observation=observation,
                        response=response,
                        actions=parsed.actions,
                        reward=reward,
                        done=done,
                        valid=valid,
                        policy_version=policy_version,
                        prompt_tokens=pending_prompt,
                        response_tokens=len(completion.token_ids),
                    )
                )
                if done:
                    break
                if turn_index == job.max_turns - 1:
                    truncated = True  # max_turns reached before the env finished
                    break
                delta = chat.next_user(completion.token_ids, next_observation)
                if max_model_len is not None and len(context.token_ids) + len(delta) >= max_model_len:
                    truncated = True  # the next observation leaves no room for a reply
                    break
                context.add_prompt(delta)
                pending_prompt = len(delta)
                observation = next_observation
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
        policy_version=policy_version,
        turns=turns,
        token_ids=context.token_ids,
        loss_mask=context.loss_mask,
        logprobs=context.logprobs,
        reward=sum(turn.reward for turn in turns),
        success=success,
        num_turns=len(turns),
        truncated=truncated,
        timings=timings,
        worker_id=worker_id,
    )


async def _generate(
    engine: EngineClient,
    prompt: list[int],
    job: RolloutJob,
    stops: list[int],
    max_tokens: int,
    seed: int | None,
    busy_timeout_s: float,
    timings: dict[str, float],
) -> Completion:
    """One completion, backing off (exponential, jittered, or the server's Retry-After) on 429."""
    deadline = time.monotonic() + busy_timeout_s
    delay = 0.05
    while True:
        try:
            return await engine.complete(prompt, job.sampling, stops, max_tokens=max_tokens, seed=seed)
        except EngineBusyError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            wait = min(left, exc.retry_after if exc.retry_after else delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, 2.0)
            timings["busy_wait_s"] += wait
            await asyncio.sleep(wait)


@dataclass(frozen=True, slots=True)
class ReplyOutcome:
    """What one reply did in the env: the format penalty plus the step's result, if it stepped."""

    reward: float
    done: bool
    valid: bool
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

    Shared by the token-level runner and the chat runner, so both score an episode the same way.
    """
    parsed = parse_reply(response, action_format, max_actions)
    action = env_action(parsed)
    if action is None:
        return parsed, ReplyOutcome(parsed.penalty, False, False, observation, None)
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
    success = step.info.get("success")
    return parsed, ReplyOutcome(
        parsed.penalty + step.reward,
        step.done,
        valid,
        step.observation,
        None if success is None else bool(success),
    )
