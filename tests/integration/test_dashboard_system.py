"""The dashboard's system view against real services: a rollout worker process that registers
itself in Redis, the CPU engine serving the tiny policy, a game env server, and Redis servers that
are stopped under the probe. Dead services are a closed port and a socket that never answers."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from conftest import RunningServer, eventually, free_port, start_engine, start_server, stop_server, wait_until

from deploy.model_init import init_tiny_model
from deploy.redis_local import start_redis_server
from services.rollout_protocol import (
    DATA_FIELD,
    EngineStatus,
    RolloutJob,
    RunKeys,
    SamplingParams,
    WorkerHeartbeat,
    WorkerStatus,
)
from trainer.dashboard.system import PROBE_DEADLINE_S, SystemProbe, SystemSnapshot

DEADLINE_S = 120.0
KEYS = RunKeys("system")
"""The run of the worker here and of its jobs; the probes read its registry and streams."""
SLACK_S = 1.0
"""What a snapshot may take beyond the probe deadline on a loaded machine (event loop, Redis)."""


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("system-model") / "policy-v0", 0, ["game"], 20, 20)


@pytest.fixture(scope="module")
def engine(tiny_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_engine(tiny_policy, tmp_path_factory.mktemp("system-engine"), "--threads", "1")
    yield server
    stop_server(server.process)


@pytest.fixture
def hanging_url() -> Iterator[str]:
    """A server that accepts connections (the kernel's backlog does) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def timed_snapshot(probe: SystemProbe) -> SystemSnapshot:
    """A snapshot, checked to come back within the probe's deadline whatever is dead."""
    started = time.monotonic()
    snapshot = await probe.snapshot()
    assert time.monotonic() - started < PROBE_DEADLINE_S + SLACK_S
    return snapshot


def registry(db: redis.Redis) -> dict[str, WorkerHeartbeat]:
    return {k.decode(): WorkerHeartbeat.model_validate_json(v) for k, v in db.hgetall(KEYS.workers).items()}


async def test_a_worker_registers_is_found_with_its_services_and_unregisters_on_a_clean_stop(
    empty_redis_url: str, game_server: RunningServer, engine: RunningServer, tiny_policy: Path, tmp_path: Path
) -> None:
    db = redis.Redis.from_url(empty_redis_url)
    port = free_port()
    args = ["rollout", "--engine-url", engine.url, "--env", f"game={game_server.url}", "--run", KEYS.run_id]
    args += ["--tokenizer", str(tiny_policy), "--port", str(port), "--consumer", "w1"]
    variables = {"REDIS_URL": empty_redis_url, "STARGYM_ROLLOUT_HEARTBEAT_S": "0.5"}
    worker = start_server(args, port, tmp_path, env=variables, name="worker")
    try:
        entry = wait_until(lambda: registry(db).get("w1"), "the worker's heartbeat", logs=[worker])
        assert entry.url == worker.url == f"http://127.0.0.1:{port}"
        assert entry.envs == {"game": [game_server.url]} and entry.engines == [engine.url]
        assert entry.heartbeat_s == 0.5 and abs(entry.updated_at - time.time()) < 30
        first_beat = entry.updated_at
        wait_until(lambda: registry(db)["w1"].updated_at > first_beat, "a second heartbeat", logs=[worker])

        httpx.post(
            f"{engine.url}/update_weight_version", json={"new_version": "3"}, timeout=10
        ).raise_for_status()
        async with SystemProbe(empty_redis_url, {}, None, run_id=KEYS.run_id, cache_s=0.0) as probe:
            before = await timed_snapshot(probe)
            (found,) = before.workers
            assert (found.worker_id, found.url, found.ok, found.error) == ("w1", worker.url, True, None)
            assert found.jobs_done == 0 and found.last_seen_s < 5
            (env_server,) = before.env_servers  # found through the worker, not configured
            assert (env_server.family, env_server.url, env_server.ok) == ("game", game_server.url, True)
            assert "game/frozenlake" in env_server.envs
            (served,) = before.engines
            assert (served.url, served.ok, served.weight_version, served.tokens_per_s) == (
                engine.url,
                True,
                3,
                None,
            )

            jobs = [
                RolloutJob(
                    run_id=KEYS.run_id,
                    env="game/frozenlake",
                    seed=seed,
                    group_id="g",
                    max_turns=3,
                    sampling=SamplingParams(max_tokens=8, seed=seed),
                    policy_version=0,
                )
                for seed in range(4)
            ]
            for job in jobs:
                db.xadd(KEYS.jobs, {DATA_FIELD: job.model_dump_json()})
            wait_until(lambda: db.xlen(KEYS.trajectories) == 4, "4 trajectories", DEADLINE_S, logs=[worker])
            after = await eventually(
                lambda: _done(probe, 4), "the worker's /status to count 4 jobs", deadline_s=DEADLINE_S
            )
            assert after.engines[0].tokens_per_s is not None and after.engines[0].tokens_per_s > 0
            assert after.engines[0].in_flight == 0
            streams = {stream.name: stream for stream in after.redis.streams}
            assert after.redis.ok and streams[KEYS.trajectories].length == 4
            assert streams[KEYS.jobs].pending == 0 and streams[KEYS.jobs].dead == 0

        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=30) in (0, -signal.SIGTERM), worker.log()
        assert db.hlen(KEYS.workers) == 0
    finally:
        stop_server(worker.process)
        db.close()


async def _done(probe: SystemProbe, jobs: int) -> SystemSnapshot | None:
    snapshot = await probe.snapshot()
    return snapshot if snapshot.workers[0].jobs_done == jobs else None


async def test_instance_count_is_the_env_servers_own(
    empty_redis_url: str, game_server: RunningServer
) -> None:
    with httpx.Client(base_url=game_server.url, timeout=10) as client:
        created = [
            client.post("/instances", json={"env": "game/frozenlake", "seed": seed}).json()["instance_id"]
            for seed in (1, 2)
        ]
        try:
            async with SystemProbe(
                empty_redis_url, {"game": game_server.url + "/"}, None, run_id=KEYS.run_id
            ) as probe:
                snapshot = await timed_snapshot(probe)
            listed = client.get("/instances").json()["count"]
            (server,) = snapshot.env_servers
            assert (server.url, server.ok, server.error) == (game_server.url, True, None)
            assert server.instances == listed >= 2
        finally:
            for instance_id in created:
                client.delete(f"/instances/{instance_id}")


async def test_a_dead_or_hanging_server_is_reported_with_its_error_in_time(
    empty_redis_url: str, game_server: RunningServer, hanging_url: str
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    servers = {"game": game_server.url, "search": closed, "web": hanging_url}
    hanging_worker = WorkerHeartbeat(
        worker_id="hanging",
        url=hanging_url,
        envs={},
        engines=[],
        heartbeat_s=2.0,
        status=_status("hanging", jobs_done=5),
        updated_at=time.time(),
    )
    with redis.Redis.from_url(empty_redis_url) as db:
        db.hset(KEYS.workers, "hanging", hanging_worker.model_dump_json())
    async with SystemProbe(empty_redis_url, servers, None, run_id=KEYS.run_id) as probe:
        snapshot = await timed_snapshot(probe)
    found = {server.family: server for server in snapshot.env_servers}
    # Probed at the same time as the hanging ones, the live server is not starved of time.
    assert found["game"].ok and found["game"].instances is not None
    assert not found["search"].ok and "cannot connect" in found["search"].error
    assert not found["web"].ok and "no answer within" in found["web"].error
    assert found["search"].instances is None and found["web"].envs == []
    (worker,) = snapshot.workers
    assert not worker.ok and "no answer within" in worker.error and worker.jobs_done == 5


async def test_redis_going_down_is_reported_and_the_rest_still_answers(game_server: RunningServer) -> None:
    server = start_redis_server()
    try:
        heartbeat = WorkerHeartbeat(
            worker_id="w-redis",
            url=None,
            envs={"game": game_server.url},
            engines=[],
            heartbeat_s=2.0,
            status=_status("w-redis"),
            updated_at=time.time(),
        )
        with redis.Redis.from_url(server.url) as db:
            db.hset(KEYS.workers, "w-redis", heartbeat.model_dump_json())
        async with SystemProbe(server.url, {}, None, run_id=KEYS.run_id, cache_s=0.0) as probe:
            up = await timed_snapshot(probe)
            assert up.redis.ok and [s.name for s in up.redis.streams] == [KEYS.jobs, KEYS.trajectories]
            assert [w.worker_id for w in up.workers] == ["w-redis"] and up.env_servers[0].ok
            server.stop()
            down = await timed_snapshot(probe)
        assert not down.redis.ok and down.redis.error and down.redis.url == server.url
        assert down.redis.streams == []
        # The registry last read still names the worker and, through it, the env server.
        assert [w.worker_id for w in down.workers] == ["w-redis"]
        assert [(s.url, s.ok) for s in down.env_servers] == [(game_server.url, True)]
    finally:
        server.stop()


async def test_a_silent_worker_is_dead_and_its_services_are_not_probed(
    empty_redis_url: str, game_server: RunningServer
) -> None:
    silent = WorkerHeartbeat(
        worker_id="crashed",
        url=f"http://127.0.0.1:{free_port()}",
        envs={"web": f"http://127.0.0.1:{free_port()}"},
        engines=[f"http://127.0.0.1:{free_port()}"],
        heartbeat_s=2.0,
        status=_status("crashed", jobs_done=7),
        updated_at=time.time() - 120,
    )
    # Beating, but its HTTP server and its engine are gone: both red with the connection error.
    dead_engine = f"http://127.0.0.1:{free_port()}"
    unreachable = silent.model_copy(
        update={
            "worker_id": "unreachable",
            "envs": {},
            "engines": [dead_engine],
            "status": _status("unreachable", jobs_done=3, engine=(dead_engine, 2)),
            "updated_at": time.time(),
        }
    )
    entries = {"crashed": silent.model_dump_json(), "unreachable": unreachable.model_dump_json()}
    with redis.Redis.from_url(empty_redis_url) as db:
        db.hset(KEYS.workers, mapping={**entries, "garbage": b"{not json"})
    async with SystemProbe(empty_redis_url, {"game": game_server.url}, None, run_id=KEYS.run_id) as probe:
        snapshot = await timed_snapshot(probe)
    found = {worker.worker_id: worker for worker in snapshot.workers}
    crashed = found["crashed"]
    assert not crashed.ok and crashed.error.startswith("no heartbeat for 12")
    assert crashed.jobs_done == 7 and crashed.last_seen_s >= 120  # its last status is still shown
    assert not found["garbage"].ok and found["garbage"].error.startswith("unreadable registry entry")
    assert not found["unreachable"].ok and "cannot connect" in found["unreachable"].error
    assert found["unreachable"].jobs_done == 3
    # The crashed worker's env server and engine are not probed; the beating one's engine is.
    assert [server.family for server in snapshot.env_servers] == ["game"]
    (engine,) = snapshot.engines
    assert (engine.url, engine.ok, engine.in_flight) == (dead_engine, False, 2)
    assert "cannot connect" in engine.error


def _status(worker_id: str, jobs_done: int = 0, engine: tuple[str, int] | None = None) -> WorkerStatus:
    """A worker's status as its heartbeat carries it; ``engine``: (URL, episodes in flight on it)."""
    engines = (
        []
        if engine is None
        else [EngineStatus(url=engine[0], policy_version=0, in_flight=engine[1], reloading=False)]
    )
    return WorkerStatus(
        worker_id=worker_id,
        concurrency=4,
        in_flight=0,
        episodes_per_s=0.0,
        tokens_per_s=0.0,
        policy_version=0,
        target_policy_version=None,
        jobs_done=jobs_done,
        jobs_failed=0,
        duplicates=0,
        reclaimed=0,
        env_retries=0,
        engine_backoffs=0,
        reloads=0,
        redis_errors=0,
        engines=engines,
        stopping=False,
        uptime_s=1.0,
    )
