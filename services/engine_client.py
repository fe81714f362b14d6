"""The async client of the engine protocol: token-in generation and the admin routes.

    async with EngineClient(["http://127.0.0.1:8210", "http://127.0.0.1:8211"]) as engine:
        completion = await engine.complete(prompt_ids, job.sampling, stop_token_ids=[508, 556])
        completion.token_ids, completion.logprobs, completion.text, completion.finish_reason

One client drives vLLM and our CPU engine alike (docs/architecture.md, "Engine protocol"): it sends only the
fields both declare (our engine answers 422 to any other) and reads vLLM's response shape. It can
hold several servers; each completion goes to the one with the fewest requests in flight from
this client (``balance="least_inflight"``, ties in turn) or simply to the next in turn
(``balance="round_robin"``). Admin calls go to every server unless ``url`` names one.

Built on :mod:`services.http_client`. 429 (the engine is at its sequence limit) is backed off and
retried there, for up to ``busy_timeout_s``, and only there: the episode loop and the worker never
retry it again; past that deadline it raises :class:`EngineBusyError`. A prompt too long for the
server's context raises :class:`EngineContextLengthError`; any other error status raises
:class:`EngineServerError`. A connection that could not be established is retried with backoff
(nothing was sent); a request that may have reached the server is not re-sent.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Unpack

from pydantic import BaseModel, ValidationError

from services.engine_protocol import (
    CollectiveRpcRequest,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    WeightInfo,
    WeightVersionUpdate,
)
from services.http_client import Answer, ClientErrors, HttpClient, ServiceClient, Transport, parse_error_body
from services.rollout_protocol import SamplingParams

M = TypeVar("M", bound=BaseModel)

BALANCES = ("least_inflight", "round_robin")


class EngineClientError(Exception):
    """Base of every error :class:`EngineClient` raises."""


class EngineServerError(EngineClientError):
    """The engine answered with an error status; ``code`` and ``message`` come from its JSON body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        method: str = "",
        url: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{method} {url} -> {status} {code}: {message}".strip())
        self.status = status
        self.code = code
        self.message = message
        self.method = method
        self.url = url
        self.retry_after = retry_after


class EngineBusyError(EngineServerError):
    """429: the engine holds as many sequences as it may. Back off and try again."""


class EngineContextLengthError(EngineServerError):
    """400: prompt plus ``max_tokens`` exceed the server's maximum model length."""


class EngineConnectionError(EngineClientError, ConnectionError):
    """The engine could not be reached, or the connection broke before an answer came."""


class EngineTimeoutError(EngineClientError, TimeoutError):
    """No answer within the timeout. The request may have been carried out; it was not re-sent."""


class EngineAbortedError(EngineClientError):
    """The server aborted the request (``finish_reason: abort``, e.g. ``/pause?mode=abort``)."""


class EngineProtocolError(EngineClientError):
    """A 2xx answer without what the protocol promises (token ids, log-probs)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled continuation: the exact token ids and the behaviour log-prob of each."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    url: str = field(default="", compare=False)
    """The server that sampled it."""
    tokens: list[str] = field(default_factory=list, compare=False)
    """Each sampled token as text (the server's ``logprobs.tokens``)."""
    top_logprobs: list[dict[str, float]] = field(default_factory=list, compare=False)
    """Per sampled token, the most likely tokens and their log-probs; empty unless asked for."""
    busy_wait_s: float = field(default=0.0, compare=False)
    """Seconds spent waiting out the server's 429s before it took the request."""


class EngineClient(ServiceClient):
    """An async client of one or more inference servers, for use as ``async with EngineClient(urls)``.

    Args:
        base_urls: one URL, a comma-separated list, or a sequence of URLs.
        model: the ``model`` field of completion requests; None leaves it out (each server then
            uses the model it serves).
        token: sent as ``Authorization: Bearer <token>``.
        timeout: seconds for a whole request (a completion waits for its whole reply).
        balance: ``least_inflight`` or ``round_robin`` (see the module docstring).
        busy_timeout_s: how long a request the engine refuses with 429 keeps being retried.
        on_busy: called for each 429 waited out (the worker counts them).
        transport: ``connect_timeout``, ``retries``, ``backoff_s`` (also the 429 backoff),
            ``max_backoff_s``, ``keepalive_s`` (see :class:`services.http_client.HttpClient`).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        model: str | None = None,
        token: str | None = None,
        timeout: float = 600.0,
        balance: str = "least_inflight",
        busy_timeout_s: float = 60.0,
        on_busy: Callable[[], None] | None = None,
        **transport: Unpack[Transport],
    ) -> None:
        urls = base_urls.split(",") if isinstance(base_urls, str) else list(base_urls)
        self.base_urls = [url.strip().rstrip("/") for url in urls if url.strip()]
        if not self.base_urls:
            raise ValueError("EngineClient needs at least one base URL")
        if len(set(self.base_urls)) != len(self.base_urls):
            raise ValueError(f"duplicate engine URLs: {self.base_urls}")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        self.model = model
        self.balance = balance
        self.inflight: dict[str, int] = dict.fromkeys(self.base_urls, 0)
        """Completions in flight from this client, per server."""
        self._turn = itertools.count()
        self.http = HttpClient(
            ClientErrors(EngineConnectionError, EngineTimeoutError),
            token=token,
            timeout=timeout,
            busy_timeout_s=busy_timeout_s,
            on_busy=on_busy,
            **transport,
        )

    # -- generation -------------------------------------------------------------------------

    def pick(self) -> str:
        """The server the next completion goes to."""
        turn = next(self._turn)
        count = len(self.base_urls)
        if self.balance == "round_robin" or count == 1:
            return self.base_urls[turn % count]
        order = [self.base_urls[(turn + offset) % count] for offset in range(count)]
        return min(order, key=self.inflight.__getitem__)

    def completion_request(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None = None,
        *,
        max_tokens: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        top_logprobs: int = 0,
    ) -> CompletionRequest:
        """The ``/v1/completions`` request. Only the fields set here are sent (``exclude_unset``):
        ones that vLLM and our engine both declare, so neither ignores nor refuses one."""
        fields: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens if max_tokens is None else max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": top_logprobs,
            "return_token_ids": True,
        }
        if stop:
            fields["stop"] = list(stop)
        if self.model is not None:
            fields["model"] = self.model
        if sampling.top_k is not None:
            fields["top_k"] = sampling.top_k
        seed = sampling.seed if seed is None else seed
        if seed is not None:
            fields["seed"] = seed
        if stop_token_ids:
            fields["stop_token_ids"] = sorted(set(stop_token_ids))
        return CompletionRequest(**fields)

    async def complete(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None = None,
        *,
        max_tokens: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        top_logprobs: int = 0,
        url: str | None = None,
    ) -> Completion:
        """Sample one continuation of ``prompt_ids``.

        ``max_tokens`` and ``seed`` override ``sampling``'s (a turn's room left in the context, a
        turn's own seed); ``stop`` strings end it (every sampled token is kept, the text is cut
        before the string); ``top_logprobs`` asks for that many most likely tokens per position;
        ``url`` picks the server instead of the balancer.
        """
        request = self.completion_request(
            prompt_ids,
            sampling,
            stop_token_ids,
            max_tokens=max_tokens,
            seed=seed,
            stop=stop,
            top_logprobs=top_logprobs,
        )
        target = self.pick() if url is None else url.rstrip("/")
        self.inflight[target] = self.inflight.get(target, 0) + 1
        try:
            completion = await self._sample(request, target)
        finally:
            self.inflight[target] -= 1
        if completion.finish_reason == "abort":
            raise EngineAbortedError(
                f"{target} aborted the completion after {len(completion.token_ids)} tokens"
            )
        return completion

    async def _sample(self, request: CompletionRequest, target: str) -> Completion:
        """``POST /v1/completions`` to ``target``: how a completion travels (an engine in this
        process is called directly, :mod:`rollout_server.engine.in_process`)."""
        answer = await self._answer("POST", target, "/v1/completions", request.model_dump(exclude_unset=True))
        response = _parse(CompletionResponse, answer.json(), target)
        return completion_of(response, target, busy_wait_s=answer.busy_wait_s)

    # -- admin ------------------------------------------------------------------------------

    async def health(self, url: str | None = None) -> dict[str, Any]:
        """``GET /health`` of each server, by URL (vLLM answers an empty body: ``{}``)."""
        return await self._each("GET", "/health", None, url)

    async def models(self, url: str | None = None) -> dict[str, list[ModelCard]]:
        """``GET /v1/models``'s ``data`` of each server, by URL."""
        answers = await self._each("GET", "/v1/models", None, url)
        return {server: _parse(ModelList, answer, server).data for server, answer in answers.items()}

    async def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` the servers report (None if none reports one)."""
        lengths = [
            card.max_model_len
            for cards in (await self.models()).values()
            for card in cards
            if card.max_model_len
        ]
        return min(lengths) if lengths else None

    async def served_model_dir(self) -> Path | None:
        """The local directory of the model the servers serve, when one holds its tokenizer.

        Ours and vLLM's ``/v1/models`` report the directory a server loaded as ``root`` (vLLM also
        as ``id`` unless ``--served-model-name`` renames it). None when no card names a directory
        on this machine with a tokenizer in it (a hub name, another machine's path).
        """
        for cards in (await self.models()).values():
            for card in cards:
                for value in (card.root, card.id):
                    if value and (Path(value) / "tokenizer_config.json").is_file():
                        return Path(value)
        return None

    async def pause(self, mode: str = "wait", url: str | None = None) -> None:
        """``POST /pause?mode=``: ``wait`` returns once the requests in flight have finished."""
        await self._each("POST", f"/pause?mode={mode}", None, url)

    async def resume(self, url: str | None = None) -> None:
        await self._each("POST", "/resume", None, url)

    async def reload_weights(self, weights_path: str | None = None, url: str | None = None) -> None:
        """``collective_rpc reload_weights``; None reloads the directory the server started with."""
        kwargs = {} if weights_path is None else {"weights_path": str(weights_path)}
        request = CollectiveRpcRequest(method="reload_weights", kwargs=kwargs)
        await self._each("POST", "/collective_rpc", request.model_dump(exclude_unset=True), url)

    async def reset_prefix_cache(self, url: str | None = None) -> None:
        await self._each("POST", "/reset_prefix_cache", None, url)

    async def update_weight_version(self, version: int | str, url: str | None = None) -> None:
        request = WeightVersionUpdate(new_version=str(version))
        await self._each("POST", "/update_weight_version", request.model_dump(), url)

    async def weight_info(self, url: str | None = None) -> dict[str, str]:
        """The weight version each server reports, by URL."""
        answers = await self._each("GET", "/weight_info", None, url)
        return {
            server: _parse(WeightInfo, answer, server).weight_version for server, answer in answers.items()
        }

    async def load_policy(self, weights_path: str, version: int | str, url: str | None = None) -> None:
        """Serve new weights: pause (wait) → reload → tag the version → resume, on every server.

        The servers are resumed even when the reload fails, so a bad checkpoint does not leave
        them paused; the error is raised after.
        """
        await self.pause("wait", url)
        try:
            await self.reload_weights(weights_path, url)
            await self.update_weight_version(version, url)
        finally:
            await self.resume(url)

    # -- transport --------------------------------------------------------------------------

    async def _each(self, method: str, path: str, body: Any, url: str | None) -> dict[str, Any]:
        servers = self.base_urls if url is None else [url.rstrip("/")]
        answers = await asyncio.gather(*(self._request(method, server, path, body) for server in servers))
        return dict(zip(servers, answers, strict=True))

    async def _request(self, method: str, base_url: str, path: str, body: Any = None) -> Any:
        """Send one request and decode its JSON (``{}`` for an empty body, as vLLM's ``/health``)."""
        answer = await self._answer(method, base_url, path, body)
        try:
            return answer.json() or {}
        except ValueError:
            return {"text": answer.payload.decode("utf-8", errors="replace")}

    async def _answer(self, method: str, base_url: str, path: str, body: Any = None) -> Answer:
        """Send one request; a non-2xx answer raises the typed :class:`EngineServerError`."""
        if not self.http.is_open:
            raise RuntimeError("EngineClient is not open: use 'async with EngineClient(...)' or await open()")
        url = base_url + path
        answer = await self.http.request(method, url, body)
        if answer.status >= 400:
            raise engine_error(answer.status, answer.payload, method, url, answer.retry_after)
        return answer


def _parse(model: type[M], payload: Any, url: str) -> M:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise EngineProtocolError(f"{url}: not a {model.__name__}: {exc}") from exc


def completion_of(response: CompletionResponse, url: str, *, busy_wait_s: float = 0.0) -> Completion:
    """The first choice of a ``/v1/completions`` response, which must hold ids and log-probs."""
    if not response.choices:
        raise EngineProtocolError(f"{url}: completion without choices")
    choice = response.choices[0]
    token_ids = choice.token_ids
    logprobs = choice.logprobs
    token_logprobs = logprobs.token_logprobs if logprobs is not None else None
    if token_ids is None or token_logprobs is None:
        raise EngineProtocolError(f"{url}: completion lacks token_ids or logprobs.token_logprobs")
    if len(token_ids) != len(token_logprobs) or any(value is None for value in token_logprobs):
        raise EngineProtocolError(
            f"{url}: {len(token_ids)} token ids but {len(token_logprobs)} log-probs (or a null one)"
        )
    return Completion(
        token_ids=list(token_ids),
        logprobs=[float(value) for value in token_logprobs if value is not None],
        text=choice.text,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        url=url,
        busy_wait_s=busy_wait_s,
        tokens=list(logprobs.tokens) if logprobs is not None else [],
        top_logprobs=[top or {} for top in logprobs.top_logprobs] if logprobs is not None else [],
    )


CONTEXT_ERROR_CODES = frozenset({"context_length_exceeded", "context_too_long"})
"""Ours and OpenAI's code for a prompt past the context; vLLM says it in the message only."""


def engine_error(
    status: int, payload: bytes, method: str, url: str, retry_after: float | None = None
) -> EngineServerError:
    """The typed error of an engine's (ours, vLLM's, an OpenAI-compatible server's) error answer."""
    code, message = parse_error_body(status, payload)
    return typed_engine_error(status, code, message, method, url, retry_after)


def typed_engine_error(
    status: int, code: str, message: str, method: str = "", url: str = "", retry_after: float | None = None
) -> EngineServerError:
    """The :class:`EngineServerError` subclass for an error status with its code and message."""
    kind = EngineServerError
    if status == 429:
        kind = EngineBusyError
    elif status == 400 and (code in CONTEXT_ERROR_CODES or "maximum context length" in message):
        kind = EngineContextLengthError
    return kind(status, code, message, method, url, retry_after)
