"""The rollout worker: turns its run's jobs (``stargym:<run>:jobs``) into trajectories
(``stargym:<run>:trajectories``). A worker serves one run, ``--run``: it loads that run's policy.

One asyncio loop does everything (docs/architecture.md, "Delivery", "Weights"):

* **consume**: read jobs in the ``rollout`` group under a consumer name unique to this process,
  never more than ``concurrency`` episodes at once;
* **play**: each job is one episode (:func:`rollout_server.episode.run_episode`, or for an
  ``agent`` job the user's agent through a recording session, :mod:`rollout_server.agent`) against one env
  server of its family (``game/frozenlake`` → a ``game`` server) and one engine, each the one with
  the fewest episodes in flight (ties in turn). An episode creates, steps and closes its env
  instance on the one server it started on; a rerun after an env error picks again;
* **replicas**: a family may have several env servers (``--env game=URL,URL``) and there may be
  several engines; a configured name that resolves to several addresses (a Kubernetes headless
  Service, ``docker compose --scale``) counts as one server per address
  (:mod:`services.endpoints`). Names are resolved again every ``resolve_interval_s``: a new env
  server takes episodes at once; a new engine first has its version read and, when the worker
  already knows the policy to serve, that policy loaded (it starts on its base weights), and only
  then takes episodes; a vanished address takes no new episodes and is closed once its running
  ones finish. A failed lookup keeps the servers last known and is logged once per failure streak;
* **complete**: :func:`services.queue.complete_job` publishes the trajectory and acks the job in
  one Lua script, deduplicated by ``job_id``: a job is acked only once its trajectory is in the
  stream, and a job run twice (after a reclaim) is published once;
* **touch / reclaim**: in-flight jobs are touched every third of the visibility timeout, so long
  episodes are not taken away; jobs pending longer than the timeout on any consumer (a dead
  worker's) are reclaimed with ``XAUTOCLAIM`` and run here, unless they were delivered
  ``max_deliveries`` times already (a poison job, one that kills every worker that runs it): that
  one is dead-lettered. Consumer names that hold nothing and were idle for the timeout (dead
  workers') are then removed from the group;
* **engine in this process** (``engine_model``): the worker loads the CPU engine itself and is its
  one engine, registered at its own URL under ``/engine``, where it serves the engine protocol;
  episodes call it without HTTP (:mod:`rollout_server.engine.in_process`), and admission and
  reloads go through that URL like any engine's;
* **reload**: the run's ``policy`` hash is watched; when it names another version, each engine is
  reloaded in turn (pause → ``reload_weights`` → ``update_weight_version`` → resume) behind a
  gate that lets the episodes running on it finish and holds new ones back. Every episode runs
  under one engine version, so every turn is tagged with the version it was sampled under;
* **failures**: an env error reruns the episode once (``env_retries``), on another env server of
  the family if it has one, then the trajectory is published with ``error`` set, naming the
  server and the cause: a job is never dropped. Every env call has a timeout
  (``env_timeout_s``), so a hung server fails the attempt instead of holding it. The
  trajectory says which server played it and why earlier attempts were rerun
  (``env_server``, ``rerun_after``). An engine's 429 is backed off and the request retried by
  the engine client (for ``engine_busy_timeout_s``; counted as ``engine_backoffs``). Redis
  errors are logged and backed off; the loop never dies of them, and from a failed Redis call
  to the next one that works, ``/health`` is a 503 naming Redis (the worker waits for it, as
  for a lost engine: not ready, but alive).
* **heartbeat**: the worker's entry in the run's ``workers`` hash (its URL, the env servers and
  engines it uses now, and :class:`WorkerStatus`) is rewritten every ``heartbeat_s`` and deleted
  on a clean stop, so the dashboard finds every worker and the services behind it;
* **shutdown**: :meth:`RolloutWorker.shutdown` (SIGTERM, through uvicorn's lifespan) stops taking
  jobs, lets in-flight episodes finish for ``shutdown_grace_s`` and abandons the rest, which stay
  pending and are reclaimed by another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollout_server.agent import HARNESS_ERRORS, MODEL_NAME, AgentHost, new_session_id, play_agent_episode
from rollout_server.episode import EpisodeEnvError, run_episode
from rollout_server.session import RecordingSession, SessionRegistry
from rollout_server.settings import WorkerSettings
from services.endpoints import Discovery, Endpoint, Resolver, ServerPool, pick_least_busy
from services.engine_client import EngineClient, EngineClientError, EngineConnectionError
from services.env_client import EnvClient, EnvClientError
from services.http_client import Backoff, HttpClient
from services.queue import (
    Delivery,
    StreamQueue,
    complete_job,
    connect,
    job_queue,
    trajectory_queue,
    watch_policy,
)
from services.rollout_protocol import (
    WORKER_ENTRY_MAX_AGE_S,
    EngineStatus,
    EnvServerStatus,
    PolicyPointer,
    RolloutJob,
    RunKeys,
    Trajectory,
    WorkerHeartbeat,
    WorkerStatus,
)

if TYPE_CHECKING:
    from rollout_server.engine.app import EngineState

logger = logging.getLogger(__name__)

EpisodeRunner = Callable[..., Awaitable[Trajectory]]
"""``run_episode(job, envs, engine, tokenizer, env_spec_instruction, policy_version)``."""

_TRANSIENT = (RedisError, OSError)
ADMIN_TIMEOUT_S = 10.0
"""Longest wait for an engine's /v1/models or /weight_info at start-up."""
PRUNE_INTERVAL_S = 60.0
"""How often a worker looks for long-dead entries in the registry (it reads the whole hash)."""
UNREGISTER_TIMEOUT_S = 2.0
"""Longest wait for removing the registry entry on stop: a dead Redis must not hold the exit up."""


def default_consumer_name() -> str:
    """Host, pid and a random suffix: unique even for a restarted process with the same pid."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ReloadGate:
    """Many episodes, or one reload, on an engine: never both.

    A pending reload holds new episodes back (so it cannot starve) and waits for the running
    ones to finish.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._reloading = False

    @property
    def reloading(self) -> bool:
        return self._reloading

    @property
    def active(self) -> int:
        return self._active

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading)
            self._reloading = True
            try:
                await self._cond.wait_for(lambda: self._active == 0)
            except BaseException:
                self._reloading = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self._reloading = False
                self._cond.notify_all()


@dataclass(eq=False)
class EngineSlot:
    """One inference server: its client, the version it serves, and its reload gate."""

    url: str
    """How it is shown (:attr:`services.endpoints.Endpoint.url`)."""
    target: str
    """What its client connects to (:attr:`services.endpoints.Endpoint.target`): what identifies it."""
    client: EngineClient
    version: int | None = None
    max_model_len: int | None = None
    gate: ReloadGate = field(default_factory=ReloadGate)
    ready: bool = False
    """Admitted (see :meth:`RolloutWorker._admit`): episodes may be sent to it."""
    lost: str | None = None
    """Why it stopped answering while it was ready (a refused or dropped connection): it takes no
    episodes until admitted again, which retries it with backoff."""
    lost_at: float = 0.0
    """``time.monotonic()`` when it was lost."""
    retired: bool = False
    """Gone from DNS: no new episodes; removed once ``leases`` is back to 0."""
    leases: int = 0
    """Episodes that picked it, running or waiting at its gate (what the least-busy choice counts)."""
    admission: asyncio.Task[None] | None = field(default=None, repr=False)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter("rollout_jobs", "Jobs completed, by outcome", ["outcome"], registry=registry)
        self.in_flight = Gauge("rollout_episodes_in_flight", "Episodes being played", registry=registry)
        self.tokens = Counter(
            "rollout_sampled_tokens", "Tokens sampled in published episodes", registry=registry
        )
        self.policy_version = Gauge(
            "rollout_policy_version", "Oldest policy version served by the engines", registry=registry
        )
        self.reloads = Counter(
            "rollout_reloads", "Engine weight reloads, by outcome", ["outcome"], registry=registry
        )
        self.redis_errors = Counter("rollout_redis_errors", "Redis calls that failed", registry=registry)
        self.env_retries = Counter(
            "rollout_env_retries", "Episodes rerun after an env error", registry=registry
        )
        self.engine_backoffs = Counter("rollout_engine_backoffs", "Engine 429s backed off", registry=registry)
        self.reclaimed = Counter(
            "rollout_reclaimed_jobs", "Jobs taken over from other consumers", registry=registry
        )
        self.episode_seconds = Histogram(
            "rollout_episode_seconds",
            "Wall time of an episode, retries included",
            registry=registry,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )


class _ServerLoad(Collector):
    """Episodes in flight per env server and per engine, read from the worker at scrape time (so a
    server that is gone simply stops being listed)."""

    def __init__(self, worker: RolloutWorker) -> None:
        self._worker = worker

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> list[GaugeMetricFamily]:
        envs, engines = self._families()
        for server in self._worker.env_server_statuses():
            envs.add_metric([server.family, server.url], server.in_flight)
        for engine in self._worker.engine_statuses():
            engines.add_metric([engine.url], engine.in_flight)
        return [envs, engines]

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "rollout_env_server_episodes_in_flight",
                "Episodes playing on each env server",
                labels=["family", "url"],
            ),
            GaugeMetricFamily(
                "rollout_engine_episodes_in_flight", "Episodes running on each engine", labels=["url"]
            ),
        )


class RolloutWorker:
    """The queue worker; run it with :meth:`run` and stop it with :meth:`shutdown`."""

    def __init__(
        self,
        settings: WorkerSettings,
        tokenizer: Any,
        *,
        registry: CollectorRegistry | None = None,
        run_episode: EpisodeRunner | None = None,
        resolver: Resolver | None = None,
        engine: EngineState | None = None,
    ) -> None:
        """``run_episode`` replaces :func:`rollout_server.episode.run_episode` (same signature);
        ``resolver`` replaces DNS (``host → addresses``, see :mod:`services.endpoints`); ``engine``
        is the engine of ``settings.engine_model``, loaded in this process, which episodes call
        directly (:mod:`rollout_server.engine.in_process`)."""
        self.settings = settings
        self.tokenizer = tokenizer
        self._engine = engine
        self.consumer = settings.consumer or default_consumer_name()
        self.keys = RunKeys(settings.run)
        self._run_episode = run_episode
        self.sessions = SessionRegistry()
        """The recording sessions of the agent episodes being played (served by rollout_server.proxy)."""
        self._harness = HttpClient(HARNESS_ERRORS, timeout=settings.agent_timeout_s)
        token = settings.api_token.get_secret_value() if settings.api_token else None
        self._agent_host = AgentHost(
            self.sessions,
            settings.local_url,
            settings.advertised_url,
            token or "EMPTY",
            settings.agent_timeout_s,
            self._harness,
        )
        registry = registry or CollectorRegistry()
        self._metrics = _Metrics(registry)
        registry.register(_ServerLoad(self))
        self._redis: Redis | None = None
        self._jobs: StreamQueue[RolloutJob] | None = None
        self._trajectories: StreamQueue[Trajectory] | None = None
        self._env_discovery = {
            family: Discovery(urls, resolver, what=f"env servers of {family!r}")
            for family, urls in settings.env_urls.items()
        }
        self._envs: dict[str, ServerPool[EnvClient]] = {}
        self._instructions: dict[str, str] = {}
        self._engine_discovery = Discovery(settings.engine_endpoints, resolver, what="engines")
        self._slots: list[EngineSlot] = []
        self._slots_changed = asyncio.Condition()
        self._engine_turn = itertools.count()
        self._in_flight: dict[str, asyncio.Task[None]] = {}  # entry id → task
        self._capacity = asyncio.Event()
        self._stopping = asyncio.Event()
        self._policy_changed = asyncio.Event()
        self._target: PolicyPointer | None = None
        self._background: list[asyncio.Task[None]] = []
        self._started = time.monotonic()
        self._completions: deque[tuple[float, int]] = deque()
        self._redis_lost: tuple[float, str] | None = None
        """``(time.monotonic(), why)`` of the first failed Redis call since the last that worked."""
        self._counts = dict.fromkeys(
            (
                "jobs_done",
                "jobs_failed",
                "duplicates",
                "reclaimed",
                "env_retries",
                "engine_backoffs",
                "reloads",
                "redis_errors",
            ),
            0,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume and play jobs until :meth:`shutdown`; returns once everything is closed."""
        try:
            await self._open()
            # Registered from the start, so a worker stuck waiting for its engines is seen too;
            # resolving too, so engines that replace unreachable ones are found while it waits.
            self._background = [
                asyncio.create_task(self._heartbeat(), name="heartbeat"),
                asyncio.create_task(self._discover(), name="discover"),
            ]
            if await self._prepare():
                self._background += [
                    asyncio.create_task(self._watch_policy(), name="watch-policy"),
                    asyncio.create_task(self._reloader(), name="reloader"),
                    asyncio.create_task(self._toucher(), name="toucher"),
                ]
                await self._consume_loop()
            await self._drain()
        finally:
            tasks = self._background + [slot.admission for slot in self._slots if slot.admission]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._unregister()
            await self._close()

    async def shutdown(self) -> None:
        """Make :meth:`run` stop taking jobs, give in-flight episodes ``shutdown_grace_s`` to
        finish and leave the rest pending (another worker reclaims them); await ``run`` to wait."""
        self._stopping.set()
        self._capacity.set()
        async with self._slots_changed:  # wakes _prepare waiting for a first engine
            self._slots_changed.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def _open(self) -> None:
        settings = self.settings
        self._redis = connect(settings.redis_url)
        self._jobs = job_queue(self._redis, self.keys, settings.max_deliveries)
        self._trajectories = trajectory_queue(self._redis, self.keys)
        env_token = settings.env_api_token.get_secret_value() if settings.env_api_token else None
        for family in self._env_discovery:
            self._envs[family] = ServerPool(
                lambda url: EnvClient(url, token=env_token, timeout=settings.env_timeout_s)
            )
        await self._harness.open()
        await self._resolve()

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self._harness.aclose()
        for pool in self._envs.values():
            await pool.aclose()
        for slot in self._slots:
            with contextlib.suppress(Exception):
                await slot.client.aclose()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    async def _prepare(self) -> bool:
        """Create the groups and wait for a first engine to be admitted; False if stopped meanwhile.

        One engine is enough to start: the others join as they are admitted, so a replica that
        never comes up does not hold the worker back.
        """
        assert self._jobs is not None and self._trajectories is not None
        backoff = Backoff(self.settings.redis_backoff_s, self.settings.redis_max_backoff_s)
        while not self.stopping:
            try:
                await self._jobs.ensure_group()
                await self._trajectories.ensure_group()
                self._redis_answered()
                break
            except _TRANSIENT as exc:
                self._redis_error("creating the consumer groups", exc)
                await self._sleep(backoff.next_delay())
        async with self._slots_changed:
            await self._slots_changed.wait_for(lambda: self.stopping or bool(self._ready_slots()))
        return not self.stopping

    async def _engine_version(self, slot: EngineSlot) -> int:
        info = await slot.client.weight_info()
        raw = next(iter(info.values()), None)
        try:
            return int(str(raw))
        except (TypeError, ValueError):
            return self.settings.initial_policy_version

    async def _drain(self) -> None:
        tasks = list(self._in_flight.values())
        if tasks:
            logger.info(
                "shutting down: %d episodes in flight, %.0f s to finish",
                len(tasks),
                self.settings.shutdown_grace_s,
            )
            _, pending = await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_s)
            for task in pending:
                task.cancel()
            if pending:
                logger.info("left %d jobs pending for other workers to reclaim", len(pending))
                await asyncio.gather(*pending, return_exceptions=True)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, cut short by shutdown."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # -- consuming ----------------------------------------------------------------------------

    async def _consume_loop(self) -> None:
        assert self._jobs is not None
        settings = self.settings
        backoff = Backoff(settings.redis_backoff_s, settings.redis_max_backoff_s)
        next_reclaim = 0.0
        min_idle_ms = int(settings.visibility_timeout_s * 1000)
        while not self.stopping:
            free = settings.concurrency - len(self._in_flight)
            if free <= 0:
                self._capacity.clear()
                await self._capacity.wait()
                continue
            try:
                deliveries: list[tuple[Delivery[RolloutJob], bool]] = []
                if time.monotonic() >= next_reclaim:
                    next_reclaim = time.monotonic() + settings.reclaim_interval_s
                    reclaimed = await self._jobs.reclaim(self.consumer, min_idle_ms, count=free)
                    deliveries += [(d, True) for d in reclaimed if d.entry_id not in self._in_flight]
                    await self._jobs.prune_consumers(min_idle_ms, keep=self.consumer)
                if len(deliveries) < free:
                    fresh = await self._jobs.consume(
                        self.consumer, count=free - len(deliveries), block_ms=settings.block_ms
                    )
                    deliveries += [(d, False) for d in fresh]
                backoff.reset()
                self._redis_answered()
            except _TRANSIENT as exc:
                self._redis_error("reading jobs", exc)
                await self._sleep(backoff.next_delay())
                continue
            except Exception:
                logger.exception("unexpected error reading jobs; retrying")
                await self._sleep(backoff.next_delay())
                continue
            for delivery, reclaimed in deliveries:
                if reclaimed:
                    self._count("reclaimed")
                    self._metrics.reclaimed.inc()
                    logger.info("reclaimed job %s (entry %s)", delivery.model.job_id, delivery.entry_id)
                task = asyncio.create_task(
                    self._run_job(delivery, reclaimed), name=f"job-{delivery.model.job_id}"
                )
                self._in_flight[delivery.entry_id] = task
                task.add_done_callback(lambda t, entry_id=delivery.entry_id: self._job_finished(entry_id, t))
            self._metrics.in_flight.set(len(self._in_flight))

    def _job_finished(self, entry_id: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "job task %s failed; the job stays pending", task.get_name(), exc_info=task.exception()
            )
        self._in_flight.pop(entry_id, None)
        self._metrics.in_flight.set(len(self._in_flight))
        self._capacity.set()

    async def _run_job(self, delivery: Delivery[RolloutJob], reclaimed: bool) -> None:
        job = delivery.model
        started = time.monotonic()
        if reclaimed and await self._already_done(job):
            logger.info("job %s already has its trajectory; acking", job.job_id)
            await self._ack_only(delivery)
            return
        try:
            trajectory = await self._play(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the runner must not drop the job
            logger.exception("job %s: episode failed unexpectedly", job.job_id)
            trajectory = self._failed(job, f"worker error: {type(exc).__name__}: {exc}")
        elapsed = time.monotonic() - started
        timings = {
            **trajectory.timings,
            "worker_s": elapsed,
            "queue_wait_s": max(0.0, time.time() - elapsed - job.created_at),
        }
        trajectory = trajectory.model_copy(update={"worker_id": self.consumer, "timings": timings})
        await self._complete(delivery, trajectory)
        self._metrics.episode_seconds.observe(elapsed)

    async def _already_done(self, job: RolloutJob) -> bool:
        assert self._redis is not None
        try:
            return bool(await self._redis.exists(self.keys.done(job.job_id)))
        except _TRANSIENT as exc:
            self._redis_error("checking a reclaimed job", exc)
            return False

    async def _ack_only(self, delivery: Delivery[RolloutJob]) -> None:
        assert self._jobs is not None
        try:
            await self._jobs.ack([delivery.entry_id])
            self._count("duplicates")
            self._metrics.jobs.labels("duplicate").inc()
        except _TRANSIENT as exc:
            self._redis_error("acking a finished job", exc)

    async def _complete(self, delivery: Delivery[RolloutJob], trajectory: Trajectory) -> None:
        """Publish and ack, retrying Redis errors until it is done (or shutdown cancels us)."""
        assert self._jobs is not None and self._trajectories is not None
        backoff = Backoff(self.settings.redis_backoff_s, self.settings.redis_max_backoff_s)
        while True:
            try:
                completion = await complete_job(
                    self.keys, self._jobs, delivery, self._trajectories, trajectory
                )
                self._redis_answered()
                break
            except _TRANSIENT as exc:
                self._redis_error(f"publishing the trajectory of job {trajectory.job_id}", exc)
                await asyncio.sleep(backoff.next_delay())
        if not completion.published:
            logger.info("job %s: trajectory already published by another run", trajectory.job_id)
            self._count("duplicates")
            self._metrics.jobs.labels("duplicate").inc()
            return
        sampled = sum(trajectory.loss_mask)
        self._completions.append((time.monotonic(), sampled))
        self._metrics.tokens.inc(sampled)
        if trajectory.error is None:
            self._count("jobs_done")
            self._metrics.jobs.labels("done").inc()
        else:
            logger.warning("job %s published with error: %s", trajectory.job_id, trajectory.error)
            self._count("jobs_failed")
            self._metrics.jobs.labels("failed").inc()

    # -- playing ------------------------------------------------------------------------------

    async def _play(self, job: RolloutJob) -> Trajectory:
        """The episode's trajectory; failures that outlast their retries come back as ``error``.

        Each attempt leases the least busy env server of the family and plays the whole episode
        there. A rerun after an env error leases another server of the family while there is one
        this episode has not failed on (a dead server, with nothing in flight, would otherwise
        look the least busy); with one server it goes back to it. The trajectory records the
        server it was played on and why each earlier attempt was abandoned.
        """
        family = job.env.split("/", 1)[0]
        pool = self._envs.get(family)
        if pool is None:
            known = ", ".join(sorted(self._envs)) or "none"
            return self._failed(job, f"no env server for family {family!r} (this worker has: {known})")
        settings = self.settings
        env_failures = engine_failures = 0
        failed_on: set[str] = set()
        reruns: list[str] = []
        backoff = Backoff(settings.engine_backoff_s, settings.engine_max_backoff_s)
        while True:
            with pool.lease(avoid=failed_on) as server:
                where = {"env_server": server.url, "rerun_after": reruns}
                try:
                    instruction = await self._instruction(server.client, job.env)
                    if instruction is None:
                        return self._failed(job, f"env {job.env!r} is not served by {server.url}", **where)
                    trajectory = await self._episode(job, server.client, instruction)
                    return trajectory.model_copy(update=where)
                except (EpisodeEnvError, EnvClientError) as exc:
                    reason = f"env server {server.url}: {exc}"
                    failed_on.add(server.target)
                    env_failures += 1
                    if env_failures > settings.env_retries:
                        return self._failed(
                            job, f"env error: {reason} (after {env_failures} attempts)", **where
                        )
                    self._count("env_retries")
                    self._metrics.env_retries.inc()
                    logger.warning("job %s: rerunning the episode after an env error: %s", job.job_id, reason)
                    reruns.append(reason)
                    continue
                except EngineClientError as exc:
                    reason = f"engine error: {exc}"
                    engine_failures += 1
                    if engine_failures > settings.engine_retries:
                        return self._failed(job, f"{reason} (after {engine_failures} attempts)", **where)
                    logger.warning("job %s: rerunning the episode after an %s", job.job_id, reason)
                    reruns.append(reason)
            await asyncio.sleep(backoff.next_delay())  # an engine error: not holding the env server

    async def _episode(self, job: RolloutJob, envs: EnvClient, instruction: str) -> Trajectory:
        slot = await self._pick_engine()
        try:
            async with slot.gate.episode():
                assert slot.version is not None
                if job.kind == "agent":
                    session = RecordingSession(
                        new_session_id(),
                        job,
                        slot.client,
                        self.tokenizer,
                        slot.version,
                        MODEL_NAME,
                        slot.max_model_len,
                    )
                    return await play_agent_episode(job, envs, instruction, session, self._agent_host)
                runner = self._run_episode or run_episode
                return await runner(
                    job,
                    envs,
                    slot.client,
                    self.tokenizer,
                    instruction,
                    slot.version,
                    max_model_len=slot.max_model_len,
                    worker_id=self.consumer,
                )
        except EngineConnectionError as exc:
            self._lose(slot, exc)
            raise
        finally:
            slot.leases -= 1

    def _lose(self, slot: EngineSlot, exc: EngineConnectionError) -> None:
        """An engine stopped answering (killed, restarting): send it nothing until it answers
        again. The episode's rerun waits for a ready engine, this one once it is re-admitted
        (a restarted engine serves its base weights, so admission reloads the run's policy)."""
        if not slot.ready or slot.retired:
            return  # already lost by another episode, or on its way out
        slot.ready, slot.version = False, None
        slot.lost, slot.lost_at = str(exc), time.monotonic()
        logger.warning("engine %s: lost (%s); no episodes go to it until it answers again", slot.url, exc)
        self._update_version_gauge()
        slot.admission = asyncio.create_task(self._admit(slot), name=f"readmit {slot.url}")

    def unhealthy(self) -> str | None:
        """Why no job can be taken or finished now, or None: Redis does not answer (its last
        call failed), or every engine this worker had is lost."""
        now = time.monotonic()
        if self._redis_lost is not None:
            since, why = self._redis_lost
            return f"Redis does not answer for {now - since:.0f} s, jobs wait for it: {why}"
        slots = [slot for slot in self._slots if not slot.retired]
        if not slots or any(slot.ready for slot in slots) or not all(slot.lost for slot in slots):
            return None
        lost = "; ".join(f"{slot.url} for {now - slot.lost_at:.0f} s ({slot.lost})" for slot in slots)
        return f"no engine answers, episodes wait for one: {lost}"

    async def _pick_engine(self) -> EngineSlot:
        """The ready engine with the fewest episodes, preferring one not being reloaded; its lease
        is taken (the caller gives it back). Waits while no engine is ready (all new or gone)."""
        async with self._slots_changed:
            await self._slots_changed.wait_for(lambda: bool(self._ready_slots()))
        ready = self._ready_slots()
        candidates = [slot for slot in ready if not slot.gate.reloading] or ready
        slot = pick_least_busy(candidates, lambda slot: slot.leases, next(self._engine_turn))
        slot.leases += 1
        return slot

    def _ready_slots(self) -> list[EngineSlot]:
        return [slot for slot in self._slots if slot.ready and not slot.retired]

    async def _instruction(self, envs: EnvClient, env_id: str) -> str | None:
        if env_id not in self._instructions:
            for spec in await envs.list_envs():
                self._instructions[spec.id] = spec.instruction
        return self._instructions.get(env_id)

    def _failed(self, job: RolloutJob, error: str, **fields: Any) -> Trajectory:
        """A trajectory of ``job`` with ``error`` set and ``fields`` (``env_server``, ``rerun_after``)."""
        version = self._served_version()
        version = job.policy_version if version is None else version
        return Trajectory.from_job(
            job, error=error, worker_id=self.consumer, policy_version=version, **fields
        )

    # -- keeping jobs ours --------------------------------------------------------------------

    async def _toucher(self) -> None:
        assert self._jobs is not None
        while True:
            await asyncio.sleep(self.settings.touch_every_s)
            ids = list(self._in_flight)
            if not ids:
                continue
            try:
                still = set(await self._jobs.touch(self.consumer, ids))
            except _TRANSIENT as exc:
                self._redis_error("touching in-flight jobs", exc)
                continue
            except Exception:
                logger.exception("unexpected error touching in-flight jobs")
                continue
            gone = [entry_id for entry_id in ids if entry_id not in still and entry_id in self._in_flight]
            if gone:
                logger.info("%d in-flight jobs are no longer pending (finished elsewhere)", len(gone))

    # -- the worker registry ------------------------------------------------------------------

    def heartbeat(self) -> WorkerHeartbeat:
        """This worker's entry in the run's worker registry (:attr:`~services.rollout_protocol.RunKeys.workers`), as of now."""
        settings = self.settings
        return WorkerHeartbeat(
            worker_id=self.consumer,
            url=settings.advertised_url,
            envs={family: [server.url for server in pool.active] for family, pool in self._envs.items()},
            engines=[slot.url for slot in self._slots if not slot.retired],
            heartbeat_s=settings.heartbeat_s,
            status=self.status(),
            updated_at=time.time(),
        )

    async def _heartbeat(self) -> None:
        """Rewrite this worker's registry entry every ``heartbeat_s``; prune long-dead entries.

        Pruning reads the whole hash, so it runs at most every :data:`PRUNE_INTERVAL_S`, not on
        every beat. A Redis error is counted and the beat skipped: the next one tries again.
        """
        assert self._redis is not None
        next_prune = 0.0
        while True:
            try:
                await self._redis.hset(self.keys.workers, self.consumer, self.heartbeat().model_dump_json())
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + PRUNE_INTERVAL_S
                    await self._prune_registry()
                self._redis_answered()
            except _TRANSIENT as exc:
                self._redis_error("writing the heartbeat", exc)
            except Exception:
                logger.exception("unexpected error writing the heartbeat")
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _prune_registry(self) -> None:
        """Delete the entries of workers silent for :data:`WORKER_ENTRY_MAX_AGE_S` (or unreadable)."""
        assert self._redis is not None
        oldest = time.time() - WORKER_ENTRY_MAX_AGE_S
        entries = await self._redis.hgetall(self.keys.workers)
        dead = [
            worker_id for worker_id, raw in entries.items() if WorkerHeartbeat.updated_at_of(raw) < oldest
        ]
        if dead:
            await self._redis.hdel(self.keys.workers, *dead)
            logger.info("pruned %d dead workers from %s", len(dead), self.keys.workers)

    async def _unregister(self) -> None:
        """Delete this worker's registry entry on a clean stop, within :data:`UNREGISTER_TIMEOUT_S`."""
        if self._redis is None:
            return
        try:
            await asyncio.wait_for(self._redis.hdel(self.keys.workers, self.consumer), UNREGISTER_TIMEOUT_S)
        except (*_TRANSIENT, TimeoutError) as exc:
            self._redis_error("removing the heartbeat", exc)

    # -- policy reloads -----------------------------------------------------------------------

    async def _watch_policy(self) -> None:
        assert self._redis is not None
        backoff = Backoff(self.settings.redis_backoff_s, self.settings.redis_max_backoff_s)
        while True:
            try:
                async for pointer in watch_policy(self._redis, self.keys, poll_s=self.settings.policy_poll_s):
                    backoff.reset()
                    logger.info("policy v%d at %s", pointer.version, pointer.path)
                    self._target = pointer
                    self._policy_changed.set()
            except _TRANSIENT as exc:
                self._redis_error("watching the policy", exc)
                await asyncio.sleep(backoff.next_delay())
            except Exception:  # e.g. a malformed policy hash: keep watching
                logger.exception("unexpected error watching the policy")
                await asyncio.sleep(backoff.next_delay())

    async def _reloader(self) -> None:
        while True:
            await self._policy_changed.wait()
            self._policy_changed.clear()
            target = self._target
            if target is None:
                continue
            failed = False
            # Engines not yet ready are brought to the target by their admission (_admit).
            for slot in list(self._slots):
                if not slot.ready or slot.retired or slot.version == target.version:
                    continue
                if not await self._reload(slot, target):
                    failed = True
            if failed and not self._policy_changed.is_set():
                await self._sleep(self.settings.reload_retry_s)
                self._policy_changed.set()

    async def _reload(self, slot: EngineSlot, pointer: PolicyPointer) -> bool:
        """Load ``pointer`` into one engine once no episode runs on it; False if that failed."""
        client = slot.client
        async with slot.gate.exclusive():
            if slot not in self._slots:  # gone from DNS and closed while this waited for the gate
                return True
            started = time.monotonic()
            try:
                # pause(wait) → reload_weights → update_weight_version → resume, resumed on failure.
                await client.load_policy(pointer.path, pointer.version)
            except Exception as exc:
                logger.error("engine %s: reload to v%d failed: %s", slot.url, pointer.version, exc)
                self._metrics.reloads.labels("failed").inc()
                return False
            logger.info(
                "engine %s: v%s → v%d in %.2f s",
                slot.url,
                slot.version,
                pointer.version,
                time.monotonic() - started,
            )
            slot.version = pointer.version
        self._count("reloads")
        self._metrics.reloads.labels("done").inc()
        self._update_version_gauge()
        return True

    def _update_version_gauge(self) -> None:
        version = self._served_version()
        if version is not None:
            self._metrics.policy_version.set(version)

    def _served_version(self) -> int | None:
        """The oldest version a ready engine serves (what a new episode may be sampled under)."""
        versions = [slot.version for slot in self._ready_slots() if slot.version is not None]
        return min(versions) if versions else None

    # -- replicas -----------------------------------------------------------------------------

    async def _discover(self) -> None:
        """Resolve the env servers' and engines' names every ``resolve_interval_s``."""
        while True:
            await asyncio.sleep(self.settings.resolve_interval_s)
            try:
                await self._resolve()
            except Exception:  # a failed lookup is handled in Discovery; this is anything else
                logger.exception("unexpected error updating the env servers and engines")

    async def _resolve(self) -> None:
        """Resolve every configured name once and use what it finds (module docstring, "replicas")."""
        families = list(self._env_discovery)
        engines, *envs = await asyncio.gather(
            self._engine_discovery.refresh(), *(self._env_discovery[family].refresh() for family in families)
        )
        for family, urls in zip(families, envs, strict=True):
            await self._envs[family].update(urls)
        await self._update_engines(engines)

    async def _update_engines(self, endpoints: list[Endpoint]) -> None:
        """Add an engine slot per new target (admitted in the background), retire those not
        named, take back retired ones named again, and close retired ones no episode holds."""
        wanted = {endpoint.target: endpoint for endpoint in endpoints}
        for slot in self._slots:
            endpoint = wanted.get(slot.target)
            if endpoint is not None:
                slot.url = endpoint.url  # a name that gained or lost addresses: same server
            if (endpoint is None) != slot.retired:
                slot.retired = endpoint is None
                if slot.retired:
                    logger.info("engine %s: gone; %d episodes on it finish there", slot.url, slot.leases)
                else:
                    logger.info("engine %s: back", slot.url)
        known = {slot.target for slot in self._slots}
        for target, endpoint in wanted.items():
            if target not in known:
                # One client per server: each has its own version and reload gate.
                slot = EngineSlot(url=endpoint.url, target=target, client=self._engine_client(target))
                await slot.client.open()
                self._slots.append(slot)
                slot.admission = asyncio.create_task(self._admit(slot), name=f"admit {endpoint.url}")
        for slot in [slot for slot in self._slots if slot.retired]:
            if slot.leases == 0 and not slot.gate.reloading:
                self._slots.remove(slot)
                if slot.admission is not None:
                    slot.admission.cancel()
                with contextlib.suppress(Exception):
                    await slot.client.aclose()
        self._update_version_gauge()
        async with self._slots_changed:  # an engine taken back may be waited for
            self._slots_changed.notify_all()

    def _engine_client(self, url: str) -> EngineClient:
        settings = self.settings
        options: dict[str, Any] = {
            "backoff_s": settings.engine_backoff_s,
            "max_backoff_s": settings.engine_max_backoff_s,
            "busy_timeout_s": settings.engine_busy_timeout_s,
            "on_busy": self._engine_busy,
        }
        if self._engine is not None:  # its admin calls go to its app, behind this worker's token
            from rollout_server.engine.in_process import InProcessEngineClient

            token = settings.api_token
            return InProcessEngineClient(
                self._engine, url, token=token.get_secret_value() if token else None, **options
            )
        token = settings.engine_api_token
        return EngineClient([url], token=token.get_secret_value() if token else None, **options)

    async def _admit(self, slot: EngineSlot) -> None:
        """Make a new engine ready: read its context length and version (retrying while it does
        not answer), load the policy the worker serves if it has another, then let episodes in.

        An engine that joins later than the worker (a replica scaled up mid-run) starts on its
        base weights; episodes sent to it before the reload would be sampled under a policy the
        trainer has long moved past. The engines of a starting worker are admitted before it
        learns the policy, and reloaded like any ready engine once it does.
        """
        backoff = Backoff(self.settings.engine_backoff_s, self.settings.engine_max_backoff_s)
        while not self.stopping and slot.version is None:
            try:
                slot.max_model_len = await asyncio.wait_for(slot.client.max_model_len(), ADMIN_TIMEOUT_S)
                slot.version = await asyncio.wait_for(self._engine_version(slot), ADMIN_TIMEOUT_S)
            except Exception as exc:
                logger.warning("engine %s: not ready yet: %s: %s", slot.url, type(exc).__name__, exc)
                await self._sleep(backoff.next_delay())
        while not self.stopping and (target := self._target) is not None and slot.version != target.version:
            if not await self._reload(slot, target):
                await self._sleep(self.settings.reload_retry_s)
        if self.stopping:
            return
        slot.ready = True
        if slot.lost is not None:
            logger.info("engine %s: back after %.0f s", slot.url, time.monotonic() - slot.lost_at)
            slot.lost = None
        logger.info("engine %s: ready, serving v%s", slot.url, slot.version)
        self._update_version_gauge()
        async with self._slots_changed:
            self._slots_changed.notify_all()

    # -- status -------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] += n

    def _engine_busy(self) -> None:
        """An engine answered 429 and its client is backing off (the only place that retries it)."""
        self._count("engine_backoffs")
        self._metrics.engine_backoffs.inc()

    def _redis_error(self, what: str, exc: BaseException) -> None:
        self._count("redis_errors")
        self._metrics.redis_errors.inc()
        logger.warning("Redis error %s: %s: %s", what, type(exc).__name__, exc)
        since = self._redis_lost[0] if self._redis_lost is not None else time.monotonic()
        self._redis_lost = (since, f"{what}: {type(exc).__name__}: {exc}")

    def _redis_answered(self) -> None:
        """A Redis call worked: Redis is no longer a reason to be unhealthy."""
        if self._redis_lost is not None:
            logger.info("Redis answers again after %.0f s", time.monotonic() - self._redis_lost[0])
            self._redis_lost = None

    def status(self) -> WorkerStatus:
        now = time.monotonic()
        window = self.settings.rate_window_s
        while self._completions and self._completions[0][0] < now - window:
            self._completions.popleft()
        span = max(min(window, now - self._started), 1e-3)
        return WorkerStatus(
            worker_id=self.consumer,
            concurrency=self.settings.concurrency,
            in_flight=len(self._in_flight),
            episodes_per_s=len(self._completions) / span,
            tokens_per_s=sum(tokens for _, tokens in self._completions) / span,
            policy_version=self._served_version(),
            target_policy_version=self._target.version if self._target else None,
            engines=self.engine_statuses(),
            env_servers=self.env_server_statuses(),
            stopping=self.stopping,
            uptime_s=now - self._started,
            **self._counts,
        )

    def engine_statuses(self) -> list[EngineStatus]:
        return [
            EngineStatus(
                url=slot.url,
                policy_version=slot.version,
                in_flight=slot.gate.active,
                reloading=slot.gate.reloading,
                ready=slot.ready,
                retired=slot.retired,
            )
            for slot in self._slots
        ]

    def env_server_statuses(self) -> list[EnvServerStatus]:
        return [
            EnvServerStatus(family=family, url=server.url, in_flight=server.in_flight, retired=server.retired)
            for family, pool in self._envs.items()
            for server in pool.servers
        ]
