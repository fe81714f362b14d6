"""The ``openai`` engine: episodes played by any OpenAI-compatible chat endpoint, for evaluation.

    async with OpenAIChatClient("https://api.openai.com/v1", "gpt-4o", api_key_from_env()) as chat:
        trajectory = await run_chat_episode(job, envs, chat, instruction)

A hosted model (GPT-4o-class, or anything behind ``/v1/chat/completions``: vLLM, our CPU engine)
sees the episode as a chat: the first user message is the env instruction (plus the action
format's instruction) and the first observation, each reply is an assistant message, each next
observation a user message; an optional system prompt comes first. Replies are parsed with
:mod:`rollout_server.actions` exactly as in training episodes, so scores are comparable: the
episode is the one loop, :func:`rollout_server.episode.play_episode`, with :class:`ChatMessages`
as its backend.

Such an endpoint returns text, not the sampled token ids and their behaviour log-probs, so the
trajectory is *text only* (``Trajectory.text_only``): ``token_ids``, ``loss_mask`` and
``logprobs`` are empty, each turn's ``prompt_tokens``/``response_tokens`` are the counts the API
reported (``usage``), and ``Trajectory.trainable`` is False, which the trainer checks.

Requests go through the ``openai`` package's async client (``openai.AsyncOpenAI``), which also
owns the retries of this engine: 429, 5xx and connection failures are retried by it (``retries``
times, ``Retry-After`` honoured), and nothing above it retries them again. Its errors are
mapped to :mod:`services.engine_client`'s types, with the body read by the one error parser of
:mod:`services.http_client`: a prompt past the context raises :class:`EngineContextLengthError`
(the episode ends truncated, as a token-level one does), a 429 that outlasts the retries
:class:`EngineBusyError`, a refused key :class:`OpenAIAuthError`, any other status
:class:`EngineServerError`.

The base URL follows the OpenAI SDK's convention: it ends with the API version
(``https://api.openai.com/v1``, ``http://127.0.0.1:8000/v1``) and ``/chat/completions`` is added;
a bare ``http://host:port`` gets ``/v1``. An endpoint that checks no key (a local vLLM, our CPU
engine) is sent ``EMPTY``, as vLLM's documentation does: the SDK refuses to run without a key.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import openai

from rollout_server.episode import AvailableActions, Reply, first_kept_turn, first_message, play_episode
from services.engine_client import (
    EngineConnectionError,
    EngineProtocolError,
    EngineServerError,
    EngineTimeoutError,
    engine_error,
)
from services.env_client import EnvClient
from services.http_client import parse_error_body
from services.rollout_protocol import ActionFormat, RolloutJob, SamplingParams, Trajectory

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_ACTION_FORMAT: ActionFormat = "answer_tags"
"""Chat models are asked for ``<think>…</think><answer>…</answer>`` unless a job says otherwise."""
NO_API_KEY = "EMPTY"
"""Sent to endpoints that check no key: the SDK needs one (vLLM's docs use the same)."""


class MissingAPIKeyError(ValueError):
    """The environment variable that should hold the API key is unset or empty."""


class OpenAIAuthError(EngineServerError):
    """401/403: the endpoint refused the API key."""


def api_key_from_env(name: str = DEFAULT_API_KEY_ENV) -> str:
    """The API key held by the environment variable ``name``; :class:`MissingAPIKeyError` if none."""
    key = os.environ.get(name, "").strip()
    if not key:
        raise MissingAPIKeyError(
            f"no API key: the environment variable {name} is not set "
            "(set it, or name another variable with --api-key-env)"
        )
    return key


def normalise_base_url(base_url: str) -> str:
    """``http://host:port`` → ``http://host:port/v1``; a URL with a path is kept (without a trailing /)."""
    url = base_url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{base_url!r} is not an http(s) URL")
    return url if parts.path else url + "/v1"


@dataclass(frozen=True, slots=True)
class ChatReply:
    """One assistant message and what the API reported about it."""

    content: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class OpenAIChatClient:
    """An async client of one OpenAI-compatible endpoint; ``async with OpenAIChatClient(...)``.

    Args:
        base_url: e.g. ``https://api.openai.com/v1`` (see :func:`normalise_base_url`).
        model: the ``model`` of every request, e.g. ``gpt-4o``.
        api_key: sent as ``Authorization: Bearer <key>``; None sends :data:`NO_API_KEY`.
        timeout: seconds for one request.
        connect_timeout: seconds to open a connection.
        retries: how many more times the SDK tries a request answered 429/5xx or that could not
            connect (its backoff, or the server's ``Retry-After``).
        max_tokens_field: ``max_tokens`` (accepted everywhere) or ``max_completion_tokens``
            (required by OpenAI's reasoning models).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 10.0,
        retries: int = 5,
        max_tokens_field: str = "max_tokens",
    ) -> None:
        if not model:
            raise ValueError("a model name is needed")
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if max_tokens_field not in ("max_tokens", "max_completion_tokens"):
            raise ValueError("max_tokens_field must be 'max_tokens' or 'max_completion_tokens'")
        self.base_url = normalise_base_url(base_url)
        self.model = model
        self.api_key = api_key or NO_API_KEY
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.max_tokens_field = max_tokens_field
        self._client: openai.AsyncOpenAI | None = None

    async def __aenter__(self) -> OpenAIChatClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                api_key=self.api_key,
                base_url=self.base_url,
                timeout=openai.Timeout(self.timeout, connect=self.connect_timeout),
                max_retries=self.retries,
            )

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    def chat_body(
        self, messages: list[dict[str, str]], sampling: SamplingParams, *, seed: int | None = None
    ) -> dict[str, Any]:
        """The arguments of ``chat.completions.create``: OpenAI's standard fields, plus ``top_k``
        in the body only when set (vLLM and our engine know it; OpenAI does not)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            self.max_tokens_field: sampling.max_tokens,
        }
        seed = sampling.seed if seed is None else seed
        if seed is not None:
            body["seed"] = seed
        if sampling.top_k is not None:
            body["extra_body"] = {"top_k": sampling.top_k}
        return body

    async def chat(
        self, messages: list[dict[str, str]], sampling: SamplingParams, *, seed: int | None = None
    ) -> ChatReply:
        """One assistant reply to ``messages``."""
        body = self.chat_body(messages, sampling, seed=seed)
        async with self._errors("POST", "/chat/completions") as client:
            response = await client.chat.completions.create(**body)
        if not response.choices:
            raise EngineProtocolError(f"{self.base_url}: chat reply without choices")
        choice = response.choices[0]
        usage = response.usage
        return ChatReply(
            content=choice.message.content or "",  # null for a refusal or a tool call
            finish_reason=choice.finish_reason,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        )

    async def models(self) -> list[str]:
        """``GET /models``: the ids the endpoint serves (also a check of reachability and key)."""
        async with self._errors("GET", "/models") as client:
            page = await client.models.list()
        return [card.id for card in page.data]

    @contextlib.asynccontextmanager
    async def _errors(self, method: str, path: str) -> Any:
        """The open SDK client, its errors turned into the engine client's typed ones."""
        if self._client is None:
            raise RuntimeError("OpenAIChatClient is not open: use 'async with OpenAIChatClient(...)'")
        url = self.base_url + path
        try:
            yield self._client
        except openai.APIStatusError as exc:
            response = exc.response
            if response.status_code in (401, 403):
                code, message = parse_error_body(response.status_code, response.content)
                raise OpenAIAuthError(response.status_code, code, message, method, url) from exc
            raise engine_error(response.status_code, response.content, method, url) from exc
        except openai.APITimeoutError as exc:
            raise EngineTimeoutError(f"{method} {url}: no answer within {self.timeout} s") from exc
        except openai.APIConnectionError as exc:
            raise EngineConnectionError(
                f"{method} {url}: cannot connect (after {self.retries + 1} tries): {exc}"
            ) from exc


@dataclass
class ChatMessages:
    """The :class:`~rollout_server.episode.EpisodeBackend` of a hosted chat model: the episode as
    chat messages (the kept ``history_turns`` window of them); the trajectory is text only."""

    client: OpenAIChatClient
    policy_version: int = 0
    system_prompt: str | None = None
    history_turns: int | None = None
    """Earlier turns each request keeps (:attr:`~services.rollout_protocol.JobFields.history_turns`)."""
    _instruction: str = ""
    _observations: list[str] = field(default_factory=list)
    _replies: list[str] = field(default_factory=list)

    async def start(
        self,
        instruction: str,
        observation: str,
        action_format: ActionFormat,
        max_actions: int,
        available_actions: AvailableActions,
    ) -> bool:
        self._instruction = instruction
        self._observations.append(observation)
        return True  # only the endpoint knows its context: a refusal ends the episode truncated

    @property
    def messages(self) -> list[dict[str, str]]:
        """What the next request sends: the system prompt, then the kept turns and the observation."""
        first = first_kept_turn(len(self._replies), self.history_turns)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append(
            {"role": "user", "content": first_message(self._instruction, self._observations[first])}
        )
        for reply, observation in zip(self._replies[first:], self._observations[first + 1 :], strict=True):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        return messages

    async def reply(self, sampling: SamplingParams, seed: int | None) -> Reply:
        answer = await self.client.chat(self.messages, sampling, seed=seed)
        self._replies.append(answer.content)
        return Reply(answer.content, answer.prompt_tokens, answer.completion_tokens)

    def observe(self, observation: str, *, last: bool) -> bool:
        self._observations.append(observation)
        return True

    def trajectory_fields(self) -> dict[str, Any]:
        return {"text_only": True}


async def run_chat_episode(
    job: RolloutJob,
    envs: EnvClient,
    client: OpenAIChatClient,
    env_spec_instruction: str,
    *,
    system_prompt: str | None = None,
    default_action_format: ActionFormat = DEFAULT_ACTION_FORMAT,
    worker_id: str = "openai",
) -> Trajectory:
    """Play ``job`` against a chat endpoint and return its text-only trajectory.

    The same loop as training episodes (:func:`rollout_server.episode.play_episode`: instruction,
    action parsing, format penalty, ``max_turns``, ``seed + turn`` per turn, the env instance
    always closed, env failures as :class:`~rollout_server.episode.EpisodeEnvError`), kept as
    chat messages instead of token ids. A context-length refusal ends the episode truncated.
    """
    backend = ChatMessages(client, job.policy_version, system_prompt, job.history_turns)
    return await play_episode(
        job,
        envs,
        backend,
        env_spec_instruction,
        worker_id=worker_id,
        default_action_format=default_action_format,
    )
