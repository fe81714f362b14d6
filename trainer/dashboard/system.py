"""The dashboard's system view: every service's health, found without being told each URL.

Discovery goes through Redis: each rollout worker keeps its entry in its run's
``stargym:<run>:workers`` hash (:class:`~services.rollout_protocol.WorkerHeartbeat`: its URL, its
env servers and its engines), so the registry plus the run's configured env servers name
everything there is to probe. A snapshot then asks each of them at once, with one deadline for
all, so a dead or hanging service costs the page a red row with its error, never a late or
blank one:

* workers: ``GET /status`` (in-flight episodes, policy version, counters); a worker whose entry
  is older than a few heartbeats is reported dead ("no heartbeat for N s") and not probed;
* env servers: ``GET /health``, ``GET /instances`` (live instances), ``GET /envs``;
* engines: ``GET /weight_info`` and the generated-token counter of ``GET /metrics`` (ours and
  vLLM's), whose change between two snapshots is the engine's tokens/s;
* Redis: the depth of the job and trajectory streams (:meth:`services.queue.StreamQueue.depth`).

When Redis cannot be read, the workers last seen in the registry are still probed directly, so
the page shows them (and their growing ``redis_errors``) instead of going blank. Snapshots are
cached for a second: several open pages polling the view do not multiply the probing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.http_client import ClientErrors, HttpClient, parse_error_body
from services.queue import connect, job_queue, trajectory_queue
from services.rollout_protocol import RunKeys, WorkerHeartbeat, WorkerStatus
from services.settings import redact_url

PROBE_DEADLINE_S = 1.5
"""Longest a snapshot takes, however many services are dead or hanging."""
CACHE_S = 1.0
"""A snapshot younger than this is served again instead of probing anew."""
STALE_HEARTBEATS = 3
"""A worker whose entry was not rewritten for this many of its heartbeats is reported dead..."""
MIN_STALE_S = 5.0
"""...and at least this long, so one slow Redis write does not flash a healthy worker red."""
GENERATED_TOKEN_COUNTERS = frozenset({"engine_generated_tokens_total", "vllm:generation_tokens_total"})
"""Prometheus samples counting sampled tokens: the CPU engine's and vLLM's."""


class StreamStatus(BaseModel):
    """One Redis stream's depth (see :class:`services.queue.QueueDepth`)."""

    name: str
    length: int
    pending: int
    lag: int
    dead: int


class RedisStatus(BaseModel):
    url: str = ""
    ok: bool
    error: str | None = None
    streams: list[StreamStatus] = []


class EnvServerStatus(BaseModel):
    family: str
    url: str
    ok: bool
    error: str | None = None
    instances: int | None = None
    envs: list[str] = []


class WorkerView(BaseModel):
    """A worker as the dashboard shows it: the live /status, else the last one its heartbeat carried."""

    worker_id: str
    url: str | None
    ok: bool
    error: str | None = None
    last_seen_s: float
    in_flight: int | None = None
    policy_version: int | None = None
    jobs_done: int | None = None
    jobs_failed: int | None = None
    env_retries: int | None = None
    redis_errors: int | None = None
    engine_backoffs: int | None = None
    episodes_per_s: float | None = None
    tokens_per_s: float | None = None


class EngineView(BaseModel):
    url: str
    ok: bool
    error: str | None = None
    weight_version: int | None = None
    tokens_per_s: float | None = None
    in_flight: int | None = None


class SystemSnapshot(BaseModel):
    """What ``GET /api/system`` answers besides ``available`` and ``reason``."""

    checked_at: float
    redis: RedisStatus
    env_servers: list[EnvServerStatus]
    workers: list[WorkerView]
    engines: list[EngineView]
    trainer: dict[str, Any] | None = None


class ProbeError(Exception):
    """A service did not answer a probe as expected; the message is what the page shows."""


class _InstanceCount(BaseModel):
    """The part of ``GET /instances`` the view needs (extra fields ignored: no need to check them)."""

    count: int


class _EnvId(BaseModel):
    id: str


class _EnvIds(BaseModel):
    envs: list[_EnvId]


def generated_tokens(metrics_text: str) -> float | None:
    """The generated-token count in a Prometheus text exposition (summed over label sets, as vLLM
    labels its counter by model); None when the text has no such counter."""
    samples = [
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name in GENERATED_TOKEN_COUNTERS
    ]
    return sum(samples) if samples else None


class CounterRates:
    """Per-second rates of monotonic counters from successive readings, one series per key."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}

    def update(self, key: str, value: float, now: float) -> float | None:
        """The rate since the previous reading of ``key``; None for the first one, or after the
        counter went back (a restarted engine), which starts the series again."""
        previous = self._last.get(key)
        self._last[key] = (now, value)
        if previous is None or value < previous[1] or now <= previous[0]:
            return None
        return (value - previous[1]) / (now - previous[0])


@dataclass
class _Registry:
    """The worker registry as last read: parsed entries, and the unreadable ones with why."""

    heartbeats: dict[str, WorkerHeartbeat]
    unreadable: dict[str, tuple[float, str]]  # worker id → (updated_at, error)
    read_now: bool
    """False when Redis could not be read and this is the last registry seen."""


class SystemProbe:
    """Builds :class:`SystemSnapshot` s; one per process, closed with :meth:`aclose`.

    Args:
        redis_url: the run's Redis; None: no registry, so only ``env_servers`` are probed.
        run_id: the run whose worker registry and streams are read (:class:`RunKeys`).
        env_servers: env server URL of each family, as configured for the run; the workers'
            own are added to them.
        api_token: sent as ``Authorization: Bearer`` to every service probed.
    """

    def __init__(
        self,
        redis_url: str | None,
        env_servers: dict[str, str],
        api_token: str | None,
        *,
        run_id: str,
        deadline_s: float = PROBE_DEADLINE_S,
        cache_s: float = CACHE_S,
    ) -> None:
        self.redis_url = redis_url
        self.keys = RunKeys(run_id)
        self.env_servers = {family: url.rstrip("/") for family, url in env_servers.items()}
        self.deadline_s = deadline_s
        self.cache_s = cache_s
        self._http = HttpClient(
            ClientErrors(ProbeError, ProbeError),
            token=api_token,
            timeout=deadline_s,
            connect_timeout=deadline_s,
            retries=0,
        )
        self._redis: Redis | None = None
        self._registry = _Registry({}, {}, read_now=False)
        self._token_rates = CounterRates()
        self._lock = asyncio.Lock()
        self._cached: tuple[float, SystemSnapshot] | None = None

    async def __aenter__(self) -> SystemProbe:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._redis is not None:
            redis, self._redis = self._redis, None
            await redis.aclose()

    async def snapshot(self) -> SystemSnapshot:
        """The system now, or as of less than ``cache_s`` ago; concurrent callers share one probe."""
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_s:
                return self._cached[1]
            snapshot = await self._probe()
            self._cached = (time.monotonic(), snapshot)
            return snapshot

    async def _probe(self) -> SystemSnapshot:
        await self._http.open()
        started = time.monotonic()
        # Half the time for Redis, the rest for the services it names: both bounded.
        redis = await self._read_redis(started + self.deadline_s / 2)
        deadline = started + self.deadline_s
        now = time.time()
        registry = self._registry
        alive = {
            worker_id: heartbeat
            for worker_id, heartbeat in registry.heartbeats.items()
            if not registry.read_now or _silence(heartbeat, now) is None
        }
        worker_ids = sorted(registry.heartbeats)
        env_targets = _env_targets(self.env_servers, alive.values())
        engine_urls = sorted({url.rstrip("/") for heartbeat in alive.values() for url in heartbeat.engines})
        # Every service at once: a hanging worker must not eat the env servers' or engines' time.
        statuses, env_servers, engines = await asyncio.gather(
            asyncio.gather(
                *(self._worker_status(alive.get(worker_id), deadline) for worker_id in worker_ids)
            ),
            asyncio.gather(*(self._env_server(family, url, deadline) for family, url in env_targets)),
            asyncio.gather(*(self._engine(url, deadline) for url in engine_urls)),
        )
        live = dict(zip(worker_ids, statuses, strict=True))
        workers = [
            _worker_view(registry.heartbeats[worker_id], now, *live[worker_id], registry.read_now)
            for worker_id in worker_ids
        ]
        workers += [
            WorkerView(worker_id=worker_id, url=None, ok=False, error=error, last_seen_s=now - updated_at)
            for worker_id, (updated_at, error) in sorted(registry.unreadable.items())
        ]
        # An engine's episodes in flight, by each live worker's newest status (/status, else heartbeat).
        newest = [live[worker_id][0] or heartbeat.status for worker_id, heartbeat in alive.items()]
        for engine in engines:
            engine.in_flight = sum(
                e.in_flight for status in newest for e in status.engines if e.url == engine.url
            )
        return SystemSnapshot(
            checked_at=now, redis=redis, env_servers=env_servers, workers=workers, engines=engines
        )

    # -- Redis --------------------------------------------------------------------------------

    async def _read_redis(self, deadline: float) -> RedisStatus:
        """Stream depths, and the registry into ``self._registry`` (kept as it was on failure)."""
        if self.redis_url is None:
            return RedisStatus(ok=False, error="no Redis URL given: workers and engines cannot be found")
        url = redact_url(self.redis_url)
        if self._redis is None:
            budget = max(self.deadline_s / 2, 0.1)
            self._redis = connect(
                self.redis_url, socket_timeout_s=budget, connect_timeout_s=budget, retries=0
            )
        redis = self._redis
        queues = (job_queue(redis, self.keys), trajectory_queue(redis, self.keys))
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                entries, *depths = await asyncio.gather(
                    redis.hgetall(self.keys.workers), *(queue.depth() for queue in queues)
                )
        except TimeoutError:
            self._registry.read_now = False
            return RedisStatus(url=url, ok=False, error=f"no answer within {self.deadline_s / 2:g} s")
        except (RedisError, OSError) as exc:
            self._registry.read_now = False
            return RedisStatus(url=url, ok=False, error=_describe(exc))
        self._registry = _parse_registry(entries)
        streams = [
            StreamStatus(name=queue.stream, length=d.length, pending=d.pending, lag=d.lag, dead=d.dead)
            for queue, d in zip(queues, depths, strict=True)
        ]
        return RedisStatus(url=url, ok=True, streams=streams)

    # -- HTTP probes --------------------------------------------------------------------------

    async def _get(self, url: str, deadline: float) -> bytes:
        """The body of a 200 answer to ``GET url`` by ``deadline``; ProbeError says why not."""
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                answer = await self._http.request("GET", url)
        except TimeoutError:
            raise ProbeError(f"GET {url}: no answer within {self.deadline_s:g} s") from None
        if answer.status != 200:
            code, message = parse_error_body(answer.status, answer.payload)
            raise ProbeError(f"GET {url}: HTTP {answer.status} {code}: {message}")
        return answer.payload

    async def _worker_status(
        self, heartbeat: WorkerHeartbeat | None, deadline: float
    ) -> tuple[WorkerStatus | None, str | None]:
        """The worker's live status, or why there is none; a silent or URL-less worker is not asked."""
        if heartbeat is None or heartbeat.url is None:
            return None, None
        try:
            return WorkerStatus.model_validate_json(
                await self._get(f"{heartbeat.url}/status", deadline)
            ), None
        except (ProbeError, ValidationError) as exc:
            return None, _describe(exc)

    async def _env_server(self, family: str, url: str, deadline: float) -> EnvServerStatus:
        answers = await _settle(
            self._get(f"{url}/{path}", deadline) for path in ("health", "instances", "envs")
        )
        try:
            _, instances, envs = (_result(answer) for answer in answers)
            count = _InstanceCount.model_validate_json(instances).count
            ids = [spec.id for spec in _EnvIds.model_validate_json(envs).envs]
        except (ProbeError, ValidationError) as exc:
            return EnvServerStatus(family=family, url=url, ok=False, error=_describe(exc))
        return EnvServerStatus(family=family, url=url, ok=True, instances=count, envs=ids)

    async def _engine(self, url: str, deadline: float) -> EngineView:
        """The engine's own view; its ``in_flight`` is the workers' to tell (filled in by the caller)."""
        answers = await _settle(self._get(f"{url}/{path}", deadline) for path in ("weight_info", "metrics"))
        try:
            info, metrics = (_result(answer) for answer in answers)
            version = _weight_version(info)
            tokens = generated_tokens(metrics.decode("utf-8", errors="replace"))
        except (ProbeError, ValueError) as exc:
            return EngineView(url=url, ok=False, error=_describe(exc))
        rate = None if tokens is None else self._token_rates.update(url, tokens, time.monotonic())
        return EngineView(url=url, ok=True, weight_version=version, tokens_per_s=rate)


def _parse_registry(entries: dict[bytes, bytes]) -> _Registry:
    heartbeats: dict[str, WorkerHeartbeat] = {}
    unreadable: dict[str, tuple[float, str]] = {}
    for raw_id, raw in entries.items():
        worker_id = raw_id.decode(errors="replace")
        try:
            heartbeats[worker_id] = WorkerHeartbeat.model_validate_json(raw)
        except ValidationError as exc:
            error = f"unreadable registry entry: {exc.errors()[0]['msg']}"
            unreadable[worker_id] = (WorkerHeartbeat.updated_at_of(raw), error)
    return _Registry(heartbeats, unreadable, read_now=True)


def _silence(heartbeat: WorkerHeartbeat, now: float) -> str | None:
    """Why the worker counts as dead by its heartbeat's age; None while it keeps beating."""
    age = now - heartbeat.updated_at
    if age > max(STALE_HEARTBEATS * heartbeat.heartbeat_s, MIN_STALE_S):
        return f"no heartbeat for {age:.0f} s"
    return None


def _worker_view(
    heartbeat: WorkerHeartbeat, now: float, live: WorkerStatus | None, error: str | None, aged: bool
) -> WorkerView:
    """``aged``: the registry was read just now, so the entry's age says whether the worker lives."""
    error = (_silence(heartbeat, now) if aged else None) or error
    status = live or heartbeat.status
    return WorkerView(
        worker_id=heartbeat.worker_id,
        url=heartbeat.url,
        ok=error is None,
        error=error,
        last_seen_s=max(now - heartbeat.updated_at, 0.0),
        in_flight=status.in_flight,
        policy_version=status.policy_version,
        jobs_done=status.jobs_done,
        jobs_failed=status.jobs_failed,
        env_retries=status.env_retries,
        redis_errors=status.redis_errors,
        engine_backoffs=status.engine_backoffs,
        episodes_per_s=status.episodes_per_s,
        tokens_per_s=status.tokens_per_s,
    )


def _env_targets(configured: dict[str, str], heartbeats: Iterable[WorkerHeartbeat]) -> list[tuple[str, str]]:
    """Every (family, URL) configured or advertised by a live worker, each once."""
    targets = set(configured.items())
    targets |= {
        (family, url.rstrip("/"))
        for heartbeat in heartbeats
        for family, urls in heartbeat.envs.items()
        for url in urls
    }
    return sorted(targets)


def _weight_version(payload: bytes) -> int | None:
    """The version in a ``/weight_info`` answer (``{"weight_version": "3"}``); None if not a number."""
    info = orjson.loads(payload)
    raw = next(iter(info.values()), None) if isinstance(info, dict) else None
    try:
        return int(str(raw))
    except ValueError:
        return None


async def _settle(probes: Iterable[Awaitable[bytes]]) -> list[bytes | BaseException]:
    """Run the probes of one service together; each answer or the exception it raised."""
    return await asyncio.gather(*probes, return_exceptions=True)


def _result(answer: bytes | BaseException) -> bytes:
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"unexpected answer: {'.'.join(map(str, first['loc']))}: {first['msg']}"
    return str(exc) or type(exc).__name__
