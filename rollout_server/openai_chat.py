"""The ``openai`` engine: episodes played by any OpenAI-compatible chat endpoint, for evaluation.

    async with OpenAIChatClient("https://api.openai.com/v1", "gpt-4o", api_key_from_env()) as chat:
        trajectory = await run_chat_episode(job, envs, chat, instruction)

A hosted model (GPT-4o-class, or anything behind ``/v1/chat/completions``: vLLM, our CPU engine)
sees the episode as a chat: the first user message is the env instruction (plus the action
format's instruction) and the first observation, each reply is an assistant message, each next
observation a user message; an optional system prompt comes first. Replies are parsed with
:mod:`rollout_server.actions` exactly as in training episodes, so scores are comparable.

Such an endpoint returns text, not the sampled token ids and their behaviour log-probs, so the
trajectory is *text only* (``Trajectory.text_only``): ``token_ids``, ``loss_mask`` and
``logprobs`` are empty, each turn's ``prompt_tokens``/``response_tokens`` are the counts the API
reported (``usage``), and ``Trajectory.trainable`` is False, which the trainer checks.

The base URL follows the OpenAI SDK's convention: it ends with the API version
(``https://api.openai.com/v1``, ``http://127.0.0.1:8000/v1``) and ``/chat/completions`` is added;
a bare ``http://host:port`` gets ``/v1``. Errors reuse :mod:`services.engine_client`'s types: a
prompt past the context raises :class:`EngineContextLengthError` (the episode ends truncated, as a
token-level one does), 429 and 5xx are retried with backoff (``Retry-After`` honoured) before
:class:`EngineBusyError`/:class:`EngineServerError`, a refused key raises :class:`OpenAIAuthError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from rollout_server.actions import format_instruction
from rollout_server.episode import INSTRUCTION_SEPARATOR, EpisodeEnvError, play_reply
from services.engine_client import (
    EngineBusyError,
    EngineConnectionError,
    EngineContextLengthError,
    EngineProtocolError,
    EngineServerError,
    EngineTimeoutError,
)
from services.env_client import EnvClient, EnvClientError
from services.rollout_protocol import ActionFormat, RolloutJob, SamplingParams, Trajectory, Turn

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_ACTION_FORMAT: ActionFormat = "answer_tags"
"""Chat models are asked for ``<think>…</think><answer>…</answer>`` unless a job says otherwise."""
CONTEXT_ERROR_CODES = frozenset({"context_length_exceeded", "context_too_long"})
NON_RETRYABLE_429_CODES = frozenset({"insufficient_quota"})
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
JSON_HEADERS = {"Content-Type": "application/json"}


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
        api_key: sent as ``Authorization: Bearer <key>``; None sends none.
        timeout: seconds for one request.
        retries: how many more times a request answered 429/5xx, or that could not connect, is tried.
        backoff_s, max_backoff_s: first wait between tries, doubling up to the maximum, jittered;
            a ``Retry-After`` header replaces it (capped at the maximum).
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
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
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
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_tokens_field = max_tokens_field
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIChatClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                cookie_jar=aiohttp.DummyCookieJar(),
            )

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def chat_body(
        self, messages: list[dict[str, str]], sampling: SamplingParams, *, seed: int | None = None
    ) -> dict[str, Any]:
        """The request body: OpenAI's standard fields only (``top_k`` only when set: vLLM knows it)."""
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
            body["top_k"] = sampling.top_k
        return body

    async def chat(
        self, messages: list[dict[str, str]], sampling: SamplingParams, *, seed: int | None = None
    ) -> ChatReply:
        """One assistant reply to ``messages``."""
        payload = await self._request(
            "POST", "/chat/completions", self.chat_body(messages, sampling, seed=seed)
        )
        try:
            choice = payload["choices"][0]
            message = choice.get("message") or {}
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise EngineProtocolError(
                f"{self.base_url}: chat reply without choices[0]: {str(payload)[:300]}"
            ) from exc
        usage = payload.get("usage") or {}
        return ChatReply(
            content=message.get("content") or "",  # null for a refusal or a tool call
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    async def models(self) -> list[str]:
        """``GET /models``: the ids the endpoint serves (also a check of reachability and key)."""
        payload = await self._request("GET", "/models")
        return [str(card.get("id")) for card in payload.get("data", []) if isinstance(card, dict)]

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        session = self._session
        if session is None:
            raise RuntimeError("OpenAIChatClient is not open: use 'async with OpenAIChatClient(...)'")
        url = self.base_url + path
        data = None if body is None else orjson.dumps(body)
        headers = None if body is None else JSON_HEADERS
        attempt = 0
        while True:
            retry_after: float | None = None
            try:
                async with session.request(method, url, data=data, headers=headers) as response:
                    status, payload = response.status, await response.read()
                    retry_after = _seconds(response.headers.get("Retry-After"))
                if status < 400:
                    break
                error = _server_error(status, payload, method, url, retry_after)
                if status not in RETRY_STATUSES or error.code in NON_RETRYABLE_429_CODES:
                    raise error
                reason: Exception = error
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                reason = EngineConnectionError(f"cannot connect to {self.base_url}: {_describe(exc)}")
            except TimeoutError as exc:
                raise EngineTimeoutError(f"{method} {url}: no answer within {self.timeout} s") from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                # A chat completion has no side effect, so a broken connection is retried too.
                reason = EngineConnectionError(f"{method} {url}: connection broke: {_describe(exc)}")
            if attempt >= self.retries:
                if isinstance(reason, EngineConnectionError):
                    raise EngineConnectionError(f"{reason} (gave up after {attempt + 1} tries)")
                raise reason
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
            await asyncio.sleep(min(self.max_backoff_s, retry_after) if retry_after else delay)
            attempt += 1
        try:
            return orjson.loads(payload) if payload else {}
        except orjson.JSONDecodeError as exc:
            raise EngineProtocolError(f"{method} {url}: the answer is not JSON: {payload[:200]!r}") from exc


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

    The same episode as :func:`rollout_server.episode.run_episode` (instruction, action parsing,
    format penalty, ``max_turns``, ``seed + turn`` per turn, the env instance always closed; env
    failures raise :class:`EpisodeEnvError`), kept as chat messages instead of token ids. A
    context-length refusal ends the episode with ``truncated=True``.
    """
    started = time.perf_counter()
    timings = {"env_s": 0.0, "generate_s": 0.0}
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

    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    turns: list[Turn] = []
    truncated = False
    success = False
    observation = created.observation
    content = f"{instruction}{INSTRUCTION_SEPARATOR}{observation}" if instruction else observation
    messages.append({"role": "user", "content": content})
    try:
        for turn_index in range(job.max_turns):
            seed = None if job.sampling.seed is None else job.sampling.seed + turn_index
            clock = time.perf_counter()
            try:
                reply = await client.chat(messages, job.sampling, seed=seed)
            except EngineContextLengthError:
                truncated = True
                break
            finally:
                timings["generate_s"] += time.perf_counter() - clock
            messages.append({"role": "assistant", "content": reply.content})
            parsed, outcome = await play_reply(
                job,
                envs,
                instance_id,
                turn_index,
                reply.content,
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
                    response=reply.content,
                    actions=parsed.actions,
                    reward=reward,
                    done=done,
                    valid=valid,
                    policy_version=job.policy_version,
                    prompt_tokens=reply.prompt_tokens,
                    response_tokens=reply.completion_tokens,
                )
            )
            if done:
                break
            if turn_index == job.max_turns - 1:
                truncated = True
                break
            messages.append({"role": "user", "content": next_observation})
            observation = next_observation
    finally:
        clock = time.perf_counter()
        with contextlib.suppress(EnvClientError):  # the server's TTL reclaims it
            await envs.close(instance_id)
        timings["env_s"] += time.perf_counter() - clock

    timings["total_s"] = time.perf_counter() - started
    return Trajectory.from_job(
        job,
        turns=turns,
        reward=sum(turn.reward for turn in turns),
        success=success,
        num_turns=len(turns),
        truncated=truncated,
        timings=timings,
        worker_id=worker_id,
        text_only=True,
    )


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _server_error(
    status: int, payload: bytes, method: str, url: str, retry_after: float | None
) -> EngineServerError:
    """OpenAI's ``{"error": {"message", "type", "code"}}``, vLLM's and ours alike; else the text."""
    code, message = "http_error", ""
    try:
        body = orjson.loads(payload)
        error = body.get("error", body) if isinstance(body, dict) else {}
        if isinstance(error, dict):
            code = str(error.get("code") or error.get("type") or code)
            message = str(error.get("message") or "")
        elif isinstance(error, str):
            message = error
    except orjson.JSONDecodeError:
        pass
    if not message:
        message = payload[:500].decode("utf-8", errors="replace").strip() or f"HTTP {status}"
    kind = EngineServerError
    if status in (401, 403):
        kind = OpenAIAuthError
    elif status == 429:
        kind = EngineBusyError
    elif status == 400 and (code in CONTEXT_ERROR_CODES or "maximum context length" in message):
        kind = EngineContextLengthError
    return kind(status, code, message, method, url, retry_after)
