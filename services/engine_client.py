"""The async client of the engine protocol: token-in generation and the admin routes.

    async with EngineClient(["http://127.0.0.1:8210", "http://127.0.0.1:8211"]) as engine:
        completion = await engine.complete(prompt_ids, job.sampling, stop_token_ids=[508, 556])
        completion.token_ids, completion.logprobs, completion.text, completion.finish_reason

One client drives vLLM and our CPU engine alike (DESIGN.md, "Engine protocol"): it sends only the
fields both declare (our engine answers 422 to any other) and reads vLLM's response shape. It can
hold several servers; each completion goes to the one with the fewest requests in flight from
this client (``balance="least_inflight"``, ties in turn) or simply to the next in turn
(``balance="round_robin"``). Admin calls go to every server unless ``url`` names one.

Failures are typed, as in :mod:`services.env_client`. 429 (the engine is at its sequence limit)
raises :class:`EngineBusyError` so that the caller backs off; a prompt too long for the server's
context raises :class:`EngineContextLengthError`; any other error status raises
:class:`EngineServerError`. A connection that could not be established is retried with backoff
(nothing was sent); a request that may have reached the server is not re-sent.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from services.rollout_protocol import SamplingParams

JSON_HEADERS = {"Content-Type": "application/json"}
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


class EngineClient:
    """An async client of one or more inference servers, for use as ``async with EngineClient(urls)``.

    Args:
        base_urls: one URL, a comma-separated list, or a sequence of URLs.
        model: the ``model`` field of completion requests; None leaves it out (each server then
            uses the model it serves).
        token: sent as ``Authorization: Bearer <token>``.
        timeout: seconds for a whole request (a completion waits for its whole reply).
        connect_timeout: seconds to open a TCP connection; one that takes longer is retried.
        retries: how many more times a request that could not connect is tried.
        backoff_s, max_backoff_s: the first retry's wait, doubling up to the maximum, jittered.
        balance: ``least_inflight`` or ``round_robin`` (see the module docstring).
        keepalive_s: how long an idle connection stays pooled (under uvicorn's 5 s keep-alive).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        model: str | None = None,
        token: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        balance: str = "least_inflight",
        keepalive_s: float = 4.0,
    ) -> None:
        urls = base_urls.split(",") if isinstance(base_urls, str) else list(base_urls)
        self.base_urls = [url.strip().rstrip("/") for url in urls if url.strip()]
        if not self.base_urls:
            raise ValueError("EngineClient needs at least one base URL")
        if len(set(self.base_urls)) != len(self.base_urls):
            raise ValueError(f"duplicate engine URLs: {self.base_urls}")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.model = model
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.balance = balance
        self.keepalive_s = keepalive_s
        self.inflight: dict[str, int] = dict.fromkeys(self.base_urls, 0)
        """Completions in flight from this client, per server."""
        self._turn = itertools.count()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Create the connection pool (done by ``async with``); must run inside the event loop."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self.keepalive_s)
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        if hasattr(self._session, "_retry_connection"):  # retrying is this client's decision
            self._session._retry_connection = False

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # -- generation -------------------------------------------------------------------------

    def pick(self) -> str:
        """The server the next completion goes to."""
        turn = next(self._turn)
        count = len(self.base_urls)
        if self.balance == "round_robin" or count == 1:
            return self.base_urls[turn % count]
        order = [self.base_urls[(turn + offset) % count] for offset in range(count)]
        return min(order, key=self.inflight.__getitem__)

    def completion_body(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None = None,
        *,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """The ``/v1/completions`` body: only fields that vLLM and our engine both declare."""
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens if max_tokens is None else max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        if sampling.top_k is not None:
            body["top_k"] = sampling.top_k
        seed = sampling.seed if seed is None else seed
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = sorted(set(stop_token_ids))
        return body

    async def complete(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None = None,
        *,
        max_tokens: int | None = None,
        seed: int | None = None,
        url: str | None = None,
    ) -> Completion:
        """Sample one continuation of ``prompt_ids``.

        ``max_tokens`` and ``seed`` override ``sampling``'s (a turn's room left in the context, a
        turn's own seed); ``url`` picks the server instead of the balancer.
        """
        body = self.completion_body(prompt_ids, sampling, stop_token_ids, max_tokens=max_tokens, seed=seed)
        target = self.pick() if url is None else url.rstrip("/")
        self.inflight[target] = self.inflight.get(target, 0) + 1
        try:
            payload = await self._request("POST", target, "/v1/completions", body)
        finally:
            self.inflight[target] -= 1
        completion = _completion(payload, target)
        if completion.finish_reason == "abort":
            raise EngineAbortedError(
                f"{target} aborted the completion after {len(completion.token_ids)} tokens"
            )
        return completion

    # -- admin ------------------------------------------------------------------------------

    async def health(self, url: str | None = None) -> dict[str, Any]:
        """``GET /health`` of each server, by URL (vLLM answers an empty body: ``{}``)."""
        return await self._each("GET", "/health", None, url)

    async def models(self, url: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """``GET /v1/models``'s ``data`` of each server, by URL."""
        answers = await self._each("GET", "/v1/models", None, url)
        return {server: answer["data"] for server, answer in answers.items()}

    async def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` the servers report (None if none reports one)."""
        lengths = [
            card["max_model_len"]
            for cards in (await self.models()).values()
            for card in cards
            if card.get("max_model_len")
        ]
        return min(lengths) if lengths else None

    async def pause(self, mode: str = "wait", url: str | None = None) -> None:
        """``POST /pause?mode=``: ``wait`` returns once the requests in flight have finished."""
        await self._each("POST", f"/pause?mode={mode}", None, url)

    async def resume(self, url: str | None = None) -> None:
        await self._each("POST", "/resume", None, url)

    async def reload_weights(self, weights_path: str | None = None, url: str | None = None) -> None:
        """``collective_rpc reload_weights``; None reloads the directory the server started with."""
        kwargs = {} if weights_path is None else {"weights_path": str(weights_path)}
        await self._each("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": kwargs}, url)

    async def reset_prefix_cache(self, url: str | None = None) -> None:
        await self._each("POST", "/reset_prefix_cache", None, url)

    async def update_weight_version(self, version: int | str, url: str | None = None) -> None:
        await self._each("POST", "/update_weight_version", {"new_version": str(version)}, url)

    async def weight_info(self, url: str | None = None) -> dict[str, str]:
        """The weight version each server reports, by URL."""
        answers = await self._each("GET", "/weight_info", None, url)
        return {server: str(answer["weight_version"]) for server, answer in answers.items()}

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
        """Send one request and decode its JSON; retry only what provably did not reach the server."""
        session = self._session
        if session is None:
            raise RuntimeError("EngineClient is not open: use 'async with EngineClient(...)' or await open()")
        url = base_url + path
        data = None if body is None else orjson.dumps(body)
        headers = None if body is None else JSON_HEADERS
        attempt = 0
        while True:
            try:
                status, payload, retry_after = await _send(session, method, url, data, headers)
                break
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                reason = f"cannot connect to {base_url}: {_describe(exc)}"
            except TimeoutError as exc:
                raise EngineTimeoutError(
                    f"{method} {url}: no answer within {self.timeout} s; it may have been carried out, "
                    "so it was not re-sent"
                ) from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                reason = f"{method} {url}: connection broke: {_describe(exc)}"
                if method != "GET":
                    raise EngineConnectionError(
                        f"{reason}; it may have been carried out, so it was not re-sent"
                    ) from exc
            if attempt >= self.retries:
                raise EngineConnectionError(f"{reason} (gave up after {attempt + 1} tries)")
            await asyncio.sleep(
                min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
            )
            attempt += 1
        if status >= 400:
            raise _server_error(status, payload, method, url, retry_after)
        if not payload:
            return {}
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            return {"text": payload.decode("utf-8", errors="replace")}


async def _send(
    session: aiohttp.ClientSession, method: str, url: str, data: bytes | None, headers: dict[str, str] | None
) -> tuple[int, bytes, float | None]:
    async with session.request(method, url, data=data, headers=headers) as response:
        retry_after = response.headers.get("Retry-After")
        try:
            seconds = float(retry_after) if retry_after is not None else None
        except ValueError:
            seconds = None
        return response.status, await response.read(), seconds


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _completion(payload: dict[str, Any], url: str) -> Completion:
    try:
        choice = payload["choices"][0]
        token_ids = choice["token_ids"]
        token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineProtocolError(f"{url}: completion without choices[0]: {str(payload)[:300]}") from exc
    if token_ids is None or token_logprobs is None:
        raise EngineProtocolError(f"{url}: completion lacks token_ids or logprobs.token_logprobs")
    if len(token_ids) != len(token_logprobs) or any(value is None for value in token_logprobs):
        raise EngineProtocolError(
            f"{url}: {len(token_ids)} token ids but {len(token_logprobs)} log-probs (or a null one)"
        )
    return Completion(
        token_ids=[int(token) for token in token_ids],
        logprobs=[float(value) for value in token_logprobs],
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        url=url,
    )


def _server_error(
    status: int, payload: bytes, method: str, url: str, retry_after: float | None
) -> EngineServerError:
    """Read our ``{"error": {"code", "message"}}`` or vLLM's ``{"error": {"message", "type"}}`` /
    ``{"object": "error", "message", "type"}``; anything else is kept as text."""
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
    if status == 429:
        kind = EngineBusyError
    elif status == 400 and (code == "context_too_long" or "maximum context length" in message):
        kind = EngineContextLengthError
    return kind(status, code, message, method, url, retry_after)
