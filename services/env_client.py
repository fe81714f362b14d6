"""The async client of the env HTTP API, used by rollout workers to play episodes.

    async with EnvClient("http://127.0.0.1:8101") as envs:
        created = await envs.create("game/frozenlake", seed=7)
        result = await envs.step(created.instance_id, "Left")
        await envs.close(created.instance_id)

Built on :mod:`services.http_client` (one connection pool for every episode of a worker, a FIFO
limit on requests in flight, connect-only retries). Failures are typed. A non-2xx answer raises
:class:`EnvServerError` with the status and the ``{"error": {"code", "message"}}`` the server
sent; it is never retried (the instance limit's 429 included: the worker decides what to do with
an env that is full). A connection that cannot be established is retried with backoff, since the
request never left; once a request may have reached the server (a read timeout, a connection
dropped mid-request), it is not sent again, because a step is not idempotent:
:class:`EnvConnectionError` or :class:`EnvTimeoutError` says so instead. Only reads (``GET``)
are also retried after a dropped connection.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Unpack
from urllib.parse import quote

from services.env_protocol import (
    BatchStepOutcome,
    EnvSpec,
    Health,
    InstanceCreated,
    InstanceList,
    InstanceState,
    Observed,
    StepResult,
)
from services.http_client import ClientErrors, HttpClient, ServiceClient, Transport, parse_error_body


class EnvClientError(Exception):
    """Base of every error :class:`EnvClient` raises."""


class EnvServerError(EnvClientError):
    """The server answered with an error status; ``code`` and ``message`` come from its JSON body."""

    def __init__(self, status: int, code: str, message: str, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path} -> {status} {code}: {message}".strip())
        self.status = status
        self.code = code
        self.message = message
        self.method = method
        self.path = path


class EnvConnectionError(EnvClientError, ConnectionError):
    """The server could not be reached, or the connection broke before an answer came."""


class EnvTimeoutError(EnvClientError, TimeoutError):
    """No answer within the timeout. The request may have been carried out; it was not re-sent."""


class EnvClient(ServiceClient):
    """An async client of one env server, for use as ``async with EnvClient(url) as client``.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8101``.
        token: sent as ``Authorization: Bearer <token>`` (the server's ``STARGYM_API_TOKEN``).
        timeout: seconds for a whole request, connecting included.
        max_connections: at most this many requests in flight (and so connections open); more
            wait their turn, first come first served. 0 is no limit.
        transport: ``connect_timeout``, ``retries``, ``backoff_s``, ``max_backoff_s``,
            ``keepalive_s`` (see :class:`services.http_client.HttpClient`).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        max_connections: int = 1024,
        **transport: Unpack[Transport],
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = HttpClient(
            ClientErrors(EnvConnectionError, EnvTimeoutError),
            token=token,
            timeout=timeout,
            max_connections=max_connections,
            auto_decompress=False,
            **transport,
        )

    # -- the env API ------------------------------------------------------------------------

    async def health(self) -> Health:
        return Health.model_validate(await self._request("GET", "/health"))

    async def list_envs(self) -> list[EnvSpec]:
        payload = await self._request("GET", "/envs")
        return [EnvSpec.model_validate(spec) for spec in payload["envs"]]

    async def create(
        self, env: str, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> InstanceCreated:
        body: dict[str, Any] = {"env": env}
        if seed is not None:
            body["seed"] = seed
        if options is not None:
            body["options"] = options
        return InstanceCreated.model_validate(await self._request("POST", "/instances", body))

    async def step(self, instance_id: str, action: str) -> StepResult:
        path = f"/instances/{_quote(instance_id)}/step"
        return StepResult.model_validate(await self._request("POST", path, {"action": action}))

    async def step_many(self, steps: Iterable[tuple[str, str]]) -> list[BatchStepOutcome]:
        """Step many instances in one request; one outcome per step, in order, each with
        ``result`` or ``error`` (a failed step does not fail the others)."""
        body = {"steps": [{"instance_id": i, "action": a} for i, a in steps]}
        payload = await self._request("POST", "/instances/step", body)
        return [BatchStepOutcome.model_validate(outcome) for outcome in payload["results"]]

    async def reset(
        self, instance_id: str, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> Observed:
        body: dict[str, Any] = {}
        if seed is not None:
            body["seed"] = seed
        if options is not None:
            body["options"] = options
        path = f"/instances/{_quote(instance_id)}/reset"
        return Observed.model_validate(await self._request("POST", path, body))

    async def get(self, instance_id: str) -> InstanceState:
        return InstanceState.model_validate(await self._request("GET", f"/instances/{_quote(instance_id)}"))

    async def list_instances(self) -> InstanceList:
        return InstanceList.model_validate(await self._request("GET", "/instances"))

    async def available_actions(self, instance_id: str) -> list[str] | None:
        return await self._request("GET", f"/instances/{_quote(instance_id)}/available_actions")

    async def close(self, instance_id: str) -> None:
        await self._request("DELETE", f"/instances/{_quote(instance_id)}")

    # -- transport --------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request and decode its JSON; a non-2xx answer raises :class:`EnvServerError`."""
        if not self.http.is_open:
            raise RuntimeError("EnvClient is not open: use 'async with EnvClient(...)' or await open()")
        answer = await self.http.request(method, self.base_url + path, body)
        if answer.status >= 400:
            code, message = parse_error_body(answer.status, answer.payload)
            raise EnvServerError(answer.status, code, message, method, path)
        return None if answer.status == 204 else answer.json()


def _quote(instance_id: str) -> str:
    return quote(instance_id, safe="")
