"""The one HTTP client layer every service client is built on (:mod:`services.env_client`,
:mod:`services.engine_client`).

    async with HttpClient(ClientErrors(MyConnectionError, MyTimeoutError)) as http:
        answer = await http.request("POST", "http://127.0.0.1:8101/instances", {"env": "game/bandit"})
        answer.status, answer.json()

What it owns, so that no client writes it again:

* **the session**: one aiohttp connection pool (aiohttp, chosen by measurement in
  ``bench/http_clients.py``: about 0.1 ms of client CPU per request where httpx spends 1-7 ms),
  idle connections kept under uvicorn's default 5 s keep-alive (vLLM's server keeps it; ours
  keep :data:`services.serving.KEEP_ALIVE_S`) so a pooled connection the server is closing is
  never reused, and aiohttp's own silent re-send of a dropped GET/PUT/DELETE turned
  off (a DELETE that did close an instance, sent again, would come back 404 for a close that
  worked);
* **a FIFO limit** on requests in flight (``max_connections``): aiohttp's own pool limit serves
  waiters out of order (measured p99 2 s at 256 clients over 16 connections, against 35 ms in
  order), so the limit is an :class:`asyncio.Semaphore`, which is first come first served;
* **connect-only retries**: a connection that could not be established is retried with
  :func:`backoff_delay`, since nothing was sent. Once a request may have reached the server (a
  read timeout, a connection dropped mid-request) it is not sent again, because a step or a
  completion is not idempotent; only ``GET`` is also retried after a dropped connection;
* **429**: this layer is the only one that waits out a server's "busy" answer. With
  ``busy_timeout_s > 0`` a 429 is retried (it was refused, so re-sending is safe) after
  :func:`backoff_delay` or the server's ``Retry-After``, until that deadline; what remains is
  returned as the 429 it is, for the client to raise its typed error. Episode loops and workers
  never retry a 429 themselves. (Hosted chat models go through the ``openai`` package, whose own
  client layer does the same for them.)
* **error bodies**: :func:`parse_error_body` reads ours (``{"error": {"code", "message"}}``),
  vLLM's and OpenAI's formats, and keeps anything else (a proxy's page) as text.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self, TypedDict

import aiohttp
import orjson

JSON_HEADERS = {"Content-Type": "application/json"}


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """The wait before retry ``attempt`` (0-based): ``base_s · 2^attempt`` capped at ``max_s``,
    jittered down to half, so that many clients do not come back in lockstep after a restart."""
    return min(max_s, base_s * 2**attempt) * (0.5 + random.random() / 2)


class Backoff:
    """:func:`backoff_delay` with its attempt counted; :meth:`reset` after a success."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.attempt = 0

    def next_delay(self) -> float:
        delay = backoff_delay(self.attempt, self.base_s, self.max_s)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


def parse_error_body(status: int, payload: bytes) -> tuple[str, str]:
    """``(code, message)`` of an error answer.

    Ours: ``{"error": {"code", "message"}}``; OpenAI's: ``{"error": {"message", "type", "code"}}``
    (``code`` may be null: ``type`` stands in); vLLM's: that, or ``{"object": "error", "message",
    "type"}``. Anything else is ``http_error`` with the start of the text.
    """
    code, message = "http_error", ""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            code = str(error.get("code") or error.get("type") or code)
            message = str(error.get("message") or "")
        elif isinstance(error, str):
            message = error
    if not message:
        message = payload[:500].decode("utf-8", errors="replace").strip() or f"HTTP {status}"
    return code, message


@dataclass(frozen=True, slots=True)
class ClientErrors:
    """The typed errors a client raises for what happens below HTTP (each client has its own)."""

    connection: type[Exception]
    """Raised when the server cannot be reached or the connection broke before an answer."""
    timeout: type[Exception]
    """Raised when no answer came within the timeout (the request may have been carried out)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer: status, raw body, the ``Retry-After`` seconds if sent, time spent on 429s."""

    status: int
    payload: bytes
    retry_after: float | None = None
    busy_wait_s: float = 0.0

    def json(self) -> Any:
        """The decoded body; None for an empty one (204, or vLLM's empty ``/health``)."""
        return orjson.loads(self.payload) if self.payload else None


class HttpClient:
    """One aiohttp session with the policies in the module docstring; ``async with HttpClient(...)``.

    Args:
        errors: the exception types to raise (see :class:`ClientErrors`).
        token: sent as ``Authorization: Bearer <token>``.
        timeout: seconds for a whole request, connecting included.
        connect_timeout: seconds to open a TCP connection; one that takes longer is retried.
        retries: how many more times a request that could not connect is tried.
        backoff_s, max_backoff_s: :func:`backoff_delay`'s base and cap.
        max_connections: at most this many requests in flight, first come first served; 0: no limit.
        keepalive_s: how long an idle connection stays pooled (under uvicorn's default 5 s keep-alive).
        busy_timeout_s: how long a request answered 429 keeps being retried; 0 returns the first 429.
        on_busy: called once for each 429 that is waited out (a worker counts them).
        auto_decompress: let aiohttp inflate compressed bodies (our servers send none).
    """

    def __init__(
        self,
        errors: ClientErrors,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        max_connections: int = 0,
        keepalive_s: float = 4.0,
        busy_timeout_s: float = 0.0,
        on_busy: Callable[[], None] | None = None,
        auto_decompress: bool = True,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if busy_timeout_s < 0:
            raise ValueError("busy_timeout_s must be >= 0")
        self.errors = errors
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.busy_timeout_s = busy_timeout_s
        self.on_busy = on_busy
        self.auto_decompress = auto_decompress
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        self._gate: asyncio.Semaphore | None = None

    async def __aenter__(self) -> HttpClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def is_open(self) -> bool:
        return self._session is not None

    async def open(self) -> None:
        """Create the connection pool; must run inside the event loop."""
        if self._session is not None:
            return
        # The limit is the FIFO semaphore; aiohttp's own one would serve waiters unfairly.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self.keepalive_s)
        self._gate = asyncio.Semaphore(self.max_connections) if self.max_connections else None
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=self.auto_decompress,
        )
        if hasattr(self._session, "_retry_connection"):  # retrying is this layer's decision alone
            self._session._retry_connection = False

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def request(self, method: str, url: str, body: Any = None) -> Answer:
        """Send one request (``body`` as JSON) and return its answer, whatever its status.

        Raises ``errors.connection`` when it could not be sent (after the retries) or broke in
        flight, ``errors.timeout`` when no answer came in time.
        """
        session = self._session
        if session is None:
            raise RuntimeError("the client is not open: use 'async with' or await open()")
        data = None if body is None else orjson.dumps(body)
        headers = None if body is None else JSON_HEADERS
        attempt = 0
        busy_attempt = 0
        busy_wait_s = 0.0
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                if self._gate is None:
                    answer = await _send(session, method, url, data, headers)
                else:
                    async with self._gate:
                        answer = await _send(session, method, url, data, headers)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # The connection was never established: nothing was sent, so trying again is safe.
                reason = f"cannot connect to {_origin(url)}: {_describe(exc)}"
            except TimeoutError as exc:  # the whole-request timeout, or a read that stalled
                raise self.errors.timeout(
                    f"{method} {url}: no answer within {self.timeout} s; the server may have carried "
                    "out the request, so it was not re-sent"
                ) from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                reason = f"{method} {url}: connection broke: {_describe(exc)}"
                if method != "GET":
                    raise self.errors.connection(
                        f"{reason}; the server may have carried out the request, so it was not re-sent"
                    ) from exc
            else:
                left = deadline - time.monotonic()
                if answer.status != 429 or left <= 0:
                    return Answer(answer.status, answer.payload, answer.retry_after, busy_wait_s)
                wait = backoff_delay(busy_attempt, self.backoff_s, self.max_backoff_s)
                if answer.retry_after is not None:
                    wait = max(wait, min(answer.retry_after, self.max_backoff_s))
                wait = min(wait, left)
                busy_attempt += 1
                busy_wait_s += wait
                if self.on_busy is not None:
                    self.on_busy()
                await asyncio.sleep(wait)
                continue
            if attempt >= self.retries:
                tries = "try" if attempt == 0 else "tries"
                raise self.errors.connection(f"{reason} (gave up after {attempt + 1} {tries})")
            await asyncio.sleep(backoff_delay(attempt, self.backoff_s, self.max_backoff_s))
            attempt += 1


class Transport(TypedDict, total=False):
    """How a service client connects and retries: the :class:`HttpClient` arguments it passes on."""

    connect_timeout: float
    retries: int
    backoff_s: float
    max_backoff_s: float
    keepalive_s: float


class ServiceClient:
    """Base of a client that owns one :class:`HttpClient` as ``http``; ``async with`` opens it."""

    http: HttpClient

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Create the connection pool (done by ``async with``); must run inside the event loop."""
        await self.http.open()

    async def aclose(self) -> None:
        await self.http.aclose()


async def _send(
    session: aiohttp.ClientSession, method: str, url: str, data: bytes | None, headers: dict[str, str] | None
) -> Answer:
    async with session.request(method, url, data=data, headers=headers) as response:
        return Answer(response.status, await response.read(), _seconds(response.headers.get("Retry-After")))


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _origin(url: str) -> str:
    parts = url.split("/", 3)
    return "/".join(parts[:3])


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
