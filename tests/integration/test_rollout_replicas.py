"""A rollout worker spreads episodes over several env servers of a family and several engines, and
follows DNS as replicas come and go: real game env servers, real CPU engines, a real Redis.

The first test runs ``stargym rollout`` with two env servers given as ``game=URL,URL``. The
others run the worker in this process with an injected resolver, so that a made-up name can stand
for several loopback addresses (Linux routes all of 127/8 to ``lo``; servers bind 127.0.0.1 and
127.0.0.2 on the same port, as replicas behind a headless Service would). The worker connects to
the addresses it resolved, so nothing else ever looks the name up.

The last tests kill (SIGKILL) or hang (SIGSTOP) an env server with episodes held on it: each
episode is replayed on another replica when there is one, or ends with an error naming the
server and the cause, within a bounded time; every job yields exactly one trajectory.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from conftest import (
    REPO_ROOT,
    STARGYM,
    RunningServer,
    eventually,
    free_port,
    stop_server,
    wait_healthy,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families
from test_worker import KEYS, make_jobs, publish, trajectories
from transformers import AutoTokenizer

from deploy.model_init import init_tiny_model
from rollout_server.settings import WorkerSettings
from rollout_server.worker import RolloutWorker
from services.queue import connect, set_policy
from services.rollout_protocol import WorkerHeartbeat

DEADLINE_S = 60.0


class TableResolver:
    """``host → addresses`` from a dict the test edits while the worker runs."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table

    async def __call__(self, host: str) -> list[str]:
        if host not in self.table:
            raise OSError(f"unknown host {host}")
        return list(self.table[host])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny policy and a second checkpoint of it (other seed, same tokenizer)."""
    root = tmp_path_factory.mktemp("replica-models")
    return (
        init_tiny_model(root / "policy-v0", 0, ["game"], 20, 20),
        init_tiny_model(root / "policy-v1", 1, ["game"], 20, 20),
    )


def launch(host: str, port: int, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
    """Start ``stargym ARGS --host HOST --port PORT`` (``start_server`` listens on 127.0.0.1 only)."""
    name = f"{args[0]}-{host}-{port}"
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*STARGYM, *args, "--host", host, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
        )
    return RunningServer(name, f"http://{host}:{port}", process, log_path)


def healthy(*started: RunningServer) -> None:
    """Wait for each server's /health; stop them all if one does not come up."""
    try:
        for server in started:
            try:
                wait_healthy(server.url, server.process)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{server.name} did not start: {exc}\n{server.log()}") from None
    except AssertionError:
        for server in started:
            stop_server(server.process)
        raise


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A CPU engine on the first checkpoint, never reloaded (the engine test starts its own)."""
    server = launch("127.0.0.1", free_port(), engine_args(models[0]), tmp_path_factory.mktemp("engine"))
    healthy(server)
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def env_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, RunningServer]]:
    """Two game env servers on one port, at 127.0.0.1 and 127.0.0.2: two replicas of one Service."""
    port = free_port()
    log_dir = tmp_path_factory.mktemp("env-replicas")
    pair = (
        launch("127.0.0.1", port, ["env", "serve", "game"], log_dir),
        launch("127.0.0.2", port, ["env", "serve", "game"], log_dir),
    )
    healthy(*pair)
    yield pair
    for server in pair:
        stop_server(server.process)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """``serve(host, port, *args, env=..., wait=True)``: :func:`launch`, and wait for it unless told
    not to (then call :func:`healthy`); every server is stopped at the end of the test."""
    started: list[RunningServer] = []

    def serve(
        host: str, port: int, *args: str, env: dict[str, str] | None = None, wait: bool = True
    ) -> RunningServer:
        started.append(launch(host, port, list(args), tmp_path, env))
        if wait:
            healthy(started[-1])
        return started[-1]

    yield serve
    for server in started:
        stop_server(server.process)


def engine_args(model: Path) -> list[str]:
    return ["engine", "serve", "--model", str(model), "--threads", "1"]


def requests_served(server: RunningServer, method: str, route: str) -> int:
    """Successful ``METHOD ROUTE`` requests the server has answered, from its own /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "http_requests_total"
            and sample.labels.get("method") == method
            and sample.labels.get("route") == route
            and sample.labels.get("status", "").startswith("2")
        )
    )


def episodes_served(env_server: RunningServer) -> int:
    return requests_served(env_server, "POST", "/instances")


async def trajectory_count(db: redis.Redis, count: int) -> bool:
    return db.xlen(KEYS.trajectories) >= count


def in_process_worker(settings: WorkerSettings, model: Path, resolver: TableResolver) -> RolloutWorker:
    return RolloutWorker(settings, AutoTokenizer.from_pretrained(model), resolver=resolver)


def test_a_family_with_two_env_servers_spreads_its_episodes_over_both(
    db: redis.Redis, servers, models: tuple[Path, Path], redis_url: str, engine, env_replicas
) -> None:
    first, second = env_replicas
    baseline = [episodes_served(first), episodes_served(second)]
    worker = servers(
        "127.0.0.1",
        free_port(),
        "rollout",
        "--engine-url",
        engine.url,
        "--env",
        f"game={first.url},{second.url}",
        "--tokenizer",
        str(models[0]),
        "--concurrency",
        "8",
        "--run",
        KEYS.run_id,
        env={"REDIS_URL": redis_url, "STARGYM_LOG_LEVEL": "info", "STARGYM_ROLLOUT_HEARTBEAT_S": "0.5"},
    )
    jobs = make_jobs(16, max_turns=4)
    publish(db, jobs)
    wait_until(lambda: db.xlen(KEYS.trajectories) >= len(jobs), "16 trajectories", DEADLINE_S, logs=[worker])
    found = trajectories(db)
    assert sorted(t.job_id for t in found) == sorted(job.job_id for job in jobs)
    assert all(t.error is None for t in found), [t.error for t in found]

    served = [episodes_served(first) - baseline[0], episodes_served(second) - baseline[1]]
    assert sum(served) == len(jobs) and min(served) >= len(jobs) // 4, served  # roughly balanced
    status = httpx.get(f"{worker.url}/status", timeout=10).json()
    assert [(s["family"], s["url"], s["in_flight"]) for s in status["env_servers"]] == [
        ("game", first.url, 0),
        ("game", second.url, 0),
    ]
    heartbeat = WorkerHeartbeat.model_validate_json(db.hget(KEYS.workers, status["worker_id"]))
    assert heartbeat.envs == {"game": [first.url, second.url]}
    metrics = httpx.get(f"{worker.url}/metrics", timeout=10).text
    for server in (first, second):
        assert f'rollout_env_server_episodes_in_flight{{family="game",url="{server.url}"}} 0.0' in metrics


async def test_a_name_with_two_addresses_is_two_env_servers_until_dns_drops_one(
    db: redis.Redis, models: tuple[Path, Path], redis_url: str, engine, env_replicas
) -> None:
    first, second = env_replicas
    port = urlsplit(first.url).port
    resolver = TableResolver({"env-game.test": ["127.0.0.1", "127.0.0.2"]})
    settings = WorkerSettings(
        redis_url=redis_url,
        run=KEYS.run_id,
        engine_urls=[engine.url],
        env_urls={"game": [f"http://env-game.test:{port}"]},
        concurrency=4,
        resolve_interval_s=0.1,
    )
    worker = in_process_worker(settings, models[0], resolver)
    running = asyncio.create_task(worker.run())
    try:

        async def env_servers() -> list[tuple[str, bool]]:
            return [(server.url, server.retired) for server in worker.status().env_servers]

        assert await eventually(env_servers, "the env servers") == [(first.url, False), (second.url, False)]
        baseline = [episodes_served(first), episodes_served(second)]
        publish(db, make_jobs(8, max_turns=4))
        await eventually(lambda: trajectory_count(db, 8), "8 trajectories", DEADLINE_S)
        before = [episodes_served(first), episodes_served(second)]
        served = [before[0] - baseline[0], before[1] - baseline[1]]
        assert sum(served) == 8 and min(served) >= 2, served

        resolver.table["env-game.test"] = ["127.0.0.1"]  # one replica gone: shown by name again
        named = [(f"http://env-game.test:{port}", False)]
        await eventually(lambda: _equals(env_servers(), named), "the dropped address to be closed")
        publish(db, make_jobs(8, max_turns=4, start=8))
        await eventually(lambda: trajectory_count(db, 16), "16 trajectories", DEADLINE_S)
        assert all(t.error is None for t in trajectories(db))
        assert episodes_served(second) == before[1]  # nothing new on the vanished replica
        assert episodes_served(first) == before[0] + 8
    finally:
        await worker.shutdown()
        await running


async def test_an_engine_replica_that_joins_loads_the_policy_before_it_takes_episodes(
    db: redis.Redis, servers, models: tuple[Path, Path], redis_url: str, game_server: RunningServer
) -> None:
    port = free_port()
    # Two replicas on their base weights; the worker learns of the second only later.
    first = servers("127.0.0.1", port, *engine_args(models[0]), wait=False)
    second = servers("127.0.0.2", port, *engine_args(models[0]), wait=False)
    healthy(first, second)
    resolver = TableResolver({"engine.test": ["127.0.0.1"]})
    settings = WorkerSettings(
        redis_url=redis_url,
        run=KEYS.run_id,
        engine_urls=[f"http://engine.test:{port}"],
        env_urls={"game": [game_server.url]},
        concurrency=4,
        resolve_interval_s=0.1,
        policy_poll_s=0.2,
    )
    worker = in_process_worker(settings, models[0], resolver)
    running = asyncio.create_task(worker.run())
    try:
        client = connect(redis_url)
        try:
            await set_policy(client, KEYS, 1, str(models[1]))
        finally:
            await client.aclose()

        async def served_version() -> int | None:
            return worker.status().policy_version

        await eventually(lambda: _equals(served_version(), 1), "the engine to serve v1", DEADLINE_S)
        # A replica scaled up mid-run runs its base weights (version 'default', read as 0), and
        # episodes are running when it appears: it must not take one before it serves v1.
        assert httpx.get(f"{second.url}/weight_info").json() == {"weight_version": "default"}
        publish(db, make_jobs(16, max_turns=6))
        resolver.table["engine.test"] = ["127.0.0.1", "127.0.0.2"]

        async def engines() -> set[tuple[str, int | None, bool]]:
            return {(e.url, e.policy_version, e.ready) for e in worker.status().engines if not e.retired}

        both = {(first.url, 1, True), (second.url, 1, True)}
        await eventually(lambda: _equals(engines(), both), "the new replica to be admitted", DEADLINE_S)
        await eventually(lambda: trajectory_count(db, 16), "16 trajectories", DEADLINE_S)
        found = trajectories(db)
        assert all(t.error is None for t in found), [t.error for t in found]
        assert {t.policy_version for t in found} == {1}
        assert httpx.get(f"{second.url}/weight_info").json() == {"weight_version": "1"}
        assert requests_served(second, "POST", "/v1/completions") > 0
        assert worker.status().reloads == 2  # the first engine once, the replica once
    finally:
        await worker.shutdown()
        await running


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


# -- an env server that dies or hangs mid-episode -------------------------------------------------

KILL_DEADLINE_S = 30.0
"""Longest wait for the episodes held on a killed or hung env server to end."""
LOST_CONNECTION = re.compile(r"connection broke: .*(reset by peer|disconnected)|Connect call failed", re.I)
"""How the HTTP client names a server killed under a request: the request was sent and its
connection reset, or (a lease is counted before its request is out) the connection refused."""


def game_servers(servers: Callable[..., RunningServer], count: int) -> list[RunningServer]:
    """``count`` game env servers on free loopback ports, started together."""
    started = [servers("127.0.0.1", free_port(), "env", "serve", "game", wait=False) for _ in range(count)]
    healthy(*started)
    return started


async def start_worker(
    settings: WorkerSettings, model: Path, db: redis.Redis
) -> tuple[RolloutWorker, asyncio.Task[None]]:
    """A worker in this process that has played one job, so it knows the env's instruction: the
    episodes after it start with ``POST /instances``, not ``GET /envs`` (which would be re-sent)."""
    worker = RolloutWorker(settings, AutoTokenizer.from_pretrained(model))
    running = asyncio.create_task(worker.run())
    publish(db, make_jobs(1, max_turns=4, start=100))
    await eventually(lambda: trajectory_count(db, 1), "the warm-up trajectory", DEADLINE_S)
    db.delete(KEYS.trajectories)
    return worker, running


def held_on(worker: RolloutWorker, server: RunningServer) -> int:
    """Episodes the worker has in flight on ``server``."""
    return sum(s.in_flight for s in worker.status().env_servers if s.url == server.url)


async def _held(worker: RolloutWorker, server: RunningServer, count: int) -> bool:
    return held_on(worker, server) == count


async def _counted(worker: RolloutWorker, count: int) -> bool:
    """Whether the worker has counted ``count`` finished jobs (warm-up included).

    A trajectory is in Redis the moment the publish script runs, but the worker counts it only
    when its task next resumes: reading the counters right after seeing the trajectory raced
    that (CI once read ``jobs_failed == 1`` with both failed trajectories already published).
    """
    status = worker.status()
    return status.jobs_done + status.jobs_failed >= count


async def test_episodes_on_a_killed_env_server_are_replayed_on_the_other_replica(
    db: redis.Redis, servers, models: tuple[Path, Path], redis_url: str, engine
) -> None:
    live, doomed = game_servers(servers, 2)
    settings = WorkerSettings(
        redis_url=redis_url,
        run=KEYS.run_id,
        engine_urls=[engine.url],
        env_urls={"game": [live.url, doomed.url]},
        concurrency=8,
    )
    worker, running = await start_worker(settings, models[0], db)
    try:
        doomed.process.send_signal(signal.SIGSTOP)  # it takes connections and answers nothing
        jobs = make_jobs(8, max_turns=4)
        publish(db, jobs)
        # Leases alternate: four episodes are held on the frozen server, four finish on the other.
        await eventually(lambda: _held(worker, doomed, 4), "four episodes held", DEADLINE_S)
        await eventually(lambda: trajectory_count(db, 4), "four trajectories", DEADLINE_S)
        assert held_on(worker, doomed) == 4
        doomed.process.kill()
        await eventually(lambda: trajectory_count(db, 8), "the held episodes replayed", KILL_DEADLINE_S)
        await eventually(lambda: _counted(worker, 9), "the worker to count the replays", DEADLINE_S)

        found = trajectories(db)
        assert sorted(t.job_id for t in found) == sorted(job.job_id for job in jobs)  # once each
        assert all(t.error is None and t.env_server == live.url for t in found), [t.error for t in found]
        replayed = [t for t in found if t.rerun_after]
        assert len(replayed) == 4
        for trajectory in replayed:
            (reason,) = trajectory.rerun_after
            assert reason.startswith(f"env server {doomed.url}: game/frozenlake: create failed:"), reason
            assert LOST_CONNECTION.search(reason), reason
        status = worker.status()
        assert status.env_retries == 4 and status.jobs_done == 9 and status.jobs_failed == 0
        assert pending_jobs(db) == 0
    finally:
        await worker.shutdown()
        await running


async def test_with_one_replica_a_killed_env_server_fails_its_episodes_naming_the_cause(
    db: redis.Redis, servers, models: tuple[Path, Path], redis_url: str, engine
) -> None:
    (server,) = game_servers(servers, 1)
    settings = WorkerSettings(
        redis_url=redis_url, run=KEYS.run_id, engine_urls=[engine.url], env_urls={"game": [server.url]}
    )
    worker, running = await start_worker(settings, models[0], db)
    try:
        server.process.send_signal(signal.SIGSTOP)
        jobs = make_jobs(2, max_turns=4)
        publish(db, jobs)
        await eventually(lambda: _held(worker, server, 2), "two episodes held", DEADLINE_S)
        server.process.kill()
        killed = time.monotonic()
        await eventually(lambda: trajectory_count(db, 2), "the held episodes to fail", KILL_DEADLINE_S)
        ended_s = time.monotonic() - killed
        await eventually(lambda: _counted(worker, 3), "the worker to count both failures", DEADLINE_S)

        found = trajectories(db)
        assert sorted(t.job_id for t in found) == sorted(job.job_id for job in jobs)
        for trajectory in found:
            # Rerun once on the only server there is; the rerun was refused, or reset when it went
            # out on a connection pooled before the kill.
            (first,) = trajectory.rerun_after
            assert first.startswith(f"env server {server.url}: game/frozenlake: create failed:"), first
            error = trajectory.error or ""
            assert error.startswith(f"env error: env server {server.url}:"), error
            assert error.endswith("(after 2 attempts)"), error
            for reason in (first, error):
                assert LOST_CONNECTION.search(reason), reason
            assert trajectory.env_server == server.url and not trajectory.trainable
        # Failed on the broken connections, not after the env timeout (60 s). How many seconds that
        # takes depends on the machine's load, so the line is the timeout, not a guess below it.
        assert ended_s < settings.env_timeout_s / 2, f"the episodes took {ended_s:.1f} s to fail"
        assert worker.status().jobs_failed == 2 and pending_jobs(db) == 0
    finally:
        await worker.shutdown()
        await running


async def test_a_hung_env_server_times_out_instead_of_holding_the_episode(
    db: redis.Redis, servers, models: tuple[Path, Path], redis_url: str, engine
) -> None:
    (server,) = game_servers(servers, 1)
    timeout_s = 1.5
    settings = WorkerSettings(
        redis_url=redis_url,
        run=KEYS.run_id,
        engine_urls=[engine.url],
        env_urls={"game": [server.url]},
        env_timeout_s=timeout_s,
    )
    worker, running = await start_worker(settings, models[0], db)
    try:
        server.process.send_signal(signal.SIGSTOP)  # never killed: it just stops answering
        publish(db, make_jobs(1, max_turns=4))
        stopped = time.monotonic()
        await eventually(lambda: trajectory_count(db, 1), "the hung episode to end", KILL_DEADLINE_S)
        ended_s = time.monotonic() - stopped

        (trajectory,) = trajectories(db)
        for reason in [*trajectory.rerun_after, trajectory.error or ""]:
            assert f"env server {server.url}: game/frozenlake: create failed:" in reason, reason
            assert f"no answer within {timeout_s} s" in reason, reason
        assert len(trajectory.rerun_after) == 1
        assert 2 * timeout_s <= ended_s < 2 * timeout_s + 5.0, ended_s  # two attempts, each timed out
    finally:
        server.process.kill()
        await worker.shutdown()
        await running


def pending_jobs(db: redis.Redis) -> int:
    return int(db.xpending(KEYS.jobs, "rollout")["pending"])
