"""The rollout worker as a real process: Redis jobs in, trajectories out, against a real game env
server and a real CPU engine serving the tiny policy.

Every worker here is ``stargym rollout`` in a subprocess; waits poll Redis or /status with a
deadline. The visibility timeout is a few seconds so that a killed worker's jobs come back fast.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from conftest import (
    POLL,
    REPO_ROOT,
    STARGYM,
    RunningServer,
    free_port,
    start_engine,
    start_family_server,
    start_server,
    stop_server,
    wait_until,
)

from deploy.model_init import init_tiny_model
from deploy.redis_local import start_redis_server
from rollout_server.settings import WorkerSettings
from rollout_server.worker import ReloadGate
from services.contracts import parse_family_urls
from services.queue import connect, set_policy
from services.rollout_protocol import (
    DATA_FIELD,
    ROLLOUT_GROUP,
    RolloutJob,
    RunKeys,
    SamplingParams,
    Trajectory,
)

VISIBILITY_TIMEOUT_S = 3.0
KEYS = RunKeys("test-worker")
"""The run every worker here serves (``--run``) and every job belongs to."""
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny policy and a second checkpoint of it (other seed, same tokenizer)."""
    root = tmp_path_factory.mktemp("worker-models")
    first = init_tiny_model(root / "policy-v0", 0, ["game"], 20, 20)
    second = init_tiny_model(root / "policy-v1", 1, ["game"], 20, 20)
    return first, second


@pytest.fixture(scope="module")
def engine(
    checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """Two sequences at most, so that eight concurrent episodes meet 429s and must back off."""
    server = start_engine(
        checkpoints[0], tmp_path_factory.mktemp("engine"), "--threads", "1", "--max-num-seqs", "2"
    )
    yield server
    stop_server(server.process)


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Starts ``stargym rollout`` processes; all are stopped at the end of the test."""
    started: list[RunningServer] = []

    def start(
        engine_url: str | None,
        envs: dict[str, str],
        tokenizer: Path | None,
        *extra: str,
        run: RunKeys = KEYS,
        **env: str,
    ) -> RunningServer:
        """``tokenizer`` None: the worker takes it from the engine's /v1/models; ``engine_url``
        None: ``extra`` says where the engine is (``--engine-model``)."""
        port = free_port()
        args = ["rollout", "--port", str(port), "--run", run.run_id]
        if engine_url is not None:
            args += ["--engine-url", engine_url]
        if tokenizer is not None:
            args += ["--tokenizer", str(tokenizer)]
        for family, url in envs.items():
            args += ["--env", f"{family}={url}"]
        variables = {
            "REDIS_URL": redis_url,
            "STARGYM_LOG_LEVEL": "info",
            "STARGYM_ROLLOUT_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S),
            "STARGYM_ROLLOUT_RECLAIM_INTERVAL_S": "0.5",
            "STARGYM_ROLLOUT_POLICY_POLL_S": "1",
            **env,
        }
        server = start_server([*args, *extra], port, tmp_path, env=variables, name=f"worker{len(started)}")
        started.append(server)
        return server

    yield start
    for server in started:
        stop_server(server.process)


def make_jobs(
    count: int, env: str = "game/frozenlake", max_turns: int = 6, start: int = 0, run: RunKeys = KEYS
) -> list[RolloutJob]:
    return [
        RolloutJob(
            run_id=run.run_id,
            env=env,
            seed=index,
            group_id=f"g{index // 2}",
            max_turns=max_turns,
            sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=index),
            policy_version=0,
        )
        for index in range(start, start + count)
    ]


def publish(db: redis.Redis, jobs: list[RolloutJob], run: RunKeys = KEYS) -> None:
    for job in jobs:
        db.xadd(run.jobs, {DATA_FIELD: job.model_dump_json()})


def trajectories(db: redis.Redis, run: RunKeys = KEYS) -> list[Trajectory]:
    return [Trajectory.model_validate_json(fields[b"data"]) for _, fields in db.xrange(run.trajectories)]


wait_for = functools.partial(wait_until, deadline_s=DEADLINE_S)
"""The suite's :func:`wait_until`, with this module's deadline (episodes on a loaded 2-core box)."""


def wait_trajectories(db: redis.Redis, count: int, logs=()) -> list[Trajectory]:
    wait_for(lambda: db.xlen(KEYS.trajectories) >= count, f"{count} trajectories", logs=logs)
    return trajectories(db)


def publish_policy(redis_url: str, version: int, path: Path) -> None:
    """What the trainer does after an update: point the run's policy at ``path`` as ``version``."""

    async def publish() -> None:
        client = connect(redis_url)
        try:
            await set_policy(client, KEYS, version, str(path))
        finally:
            await client.aclose()

    asyncio.run(publish())


def status(worker: RunningServer) -> dict:
    response = POLL.get(f"{worker.url}/status", timeout=10)
    response.raise_for_status()
    return response.json()


def pending_jobs(db: redis.Redis) -> int:
    return int(db.xpending(KEYS.jobs, ROLLOUT_GROUP)["pending"])


def held_by(db: redis.Redis, consumer: str) -> list[dict]:
    """The jobs ``consumer`` holds; none while no worker has made the group yet (a worker answers
    /health before its first read creates the group: CI-like load saw NOGROUP here)."""
    try:
        return db.xpending_range(KEYS.jobs, ROLLOUT_GROUP, "-", "+", 10, consumername=consumer)
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        return []


def test_every_job_yields_one_trajectory_and_is_acked(
    db: redis.Redis, workers, engine: RunningServer, game_server: RunningServer, checkpoints
) -> None:
    jobs = make_jobs(12)
    # No --tokenizer: the worker loads the one of the model directory the engine reports.
    worker = workers(engine.url, {"game": game_server.url}, None, "--concurrency", "8")
    publish(db, jobs)
    found = wait_trajectories(db, len(jobs), logs=[worker])
    assert sorted(t.job_id for t in found) == sorted(job.job_id for job in jobs)
    by_id = {job.job_id: job for job in jobs}
    for trajectory in found:
        job = by_id[trajectory.job_id]
        assert trajectory.error is None, trajectory.error
        assert (trajectory.env, trajectory.seed, trajectory.group_id) == (job.env, job.seed, job.group_id)
        assert 1 <= trajectory.num_turns <= job.max_turns
        assert trajectory.policy_version == 0
        assert all(turn.policy_version == 0 for turn in trajectory.turns)
        assert sum(trajectory.loss_mask) == sum(turn.response_tokens for turn in trajectory.turns) > 0
        assert trajectory.worker_id and trajectory.timings["queue_wait_s"] >= 0
    wait_for(lambda: pending_jobs(db) == 0, "the jobs to be acked")
    assert db.xlen(KEYS.jobs) == 0  # acked jobs are deleted

    report = wait_for(lambda: (s := status(worker))["jobs_done"] == len(jobs) and s, "/status counts")
    assert report["jobs_failed"] == 0 and report["in_flight"] == 0
    assert report["episodes_per_s"] > 0 and report["tokens_per_s"] > 0
    assert report["policy_version"] == 0
    # Eight concurrent episodes on an engine that holds two sequences: 429s, backed off, no errors.
    assert report["engine_backoffs"] > 0
    metrics = httpx.get(f"{worker.url}/metrics").text
    assert 'rollout_jobs_total{outcome="done"} 12.0' in metrics


def test_failed_episodes_are_published_with_an_error(
    db: redis.Redis, workers, engine: RunningServer, game_server: RunningServer, checkpoints
) -> None:
    dead_port = free_port()  # nothing listens there: every env call fails to connect
    worker = workers(
        engine.url, {"game": game_server.url, "web": f"http://127.0.0.1:{dead_port}"}, checkpoints[0]
    )
    unknown_family = make_jobs(1, env="nosuch/env")[0]
    unknown_env = make_jobs(1, env="game/nosuch", start=1)[0]
    env_down = make_jobs(1, env="web/shop", start=2)[0]
    fine = make_jobs(1, start=3)[0]
    publish(db, [unknown_family, unknown_env, env_down, fine])
    found = {t.job_id: t for t in wait_trajectories(db, 4, logs=[worker])}
    assert len(found) == 4
    assert "no env server for family 'nosuch'" in found[unknown_family.job_id].error
    assert "game/nosuch" in found[unknown_env.job_id].error
    assert (
        found[env_down.job_id].error.startswith("env error") and "2 attempts" in found[env_down.job_id].error
    )
    assert found[fine.job_id].error is None
    for job in (unknown_family, unknown_env, env_down):
        assert found[job.job_id].turns == [] and found[job.job_id].token_ids == []
    wait_for(lambda: pending_jobs(db) == 0, "the jobs to be acked")
    report = wait_for(lambda: (s := status(worker))["jobs_done"] + s["jobs_failed"] == 4 and s, "/status")
    assert (report["jobs_done"], report["jobs_failed"]) == (1, 3)
    assert report["env_retries"] == 1  # the unreachable env server, rerun once


def test_a_killed_worker_loses_no_job_and_duplicates_none(
    db: redis.Redis, workers, engine: RunningServer, game_server: RunningServer, checkpoints
) -> None:
    jobs = make_jobs(16, max_turns=10)
    envs = {"game": game_server.url}
    doomed = workers(engine.url, envs, checkpoints[0], "--concurrency", "4", "--consumer", "doomed")
    survivor = workers(engine.url, envs, checkpoints[0], "--concurrency", "4", "--consumer", "survivor")
    publish(db, jobs)
    wait_for(lambda: status(doomed)["in_flight"] > 0, "the first worker to be mid-episode")
    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(timeout=10)
    orphans = db.xpending_range(KEYS.jobs, ROLLOUT_GROUP, "-", "+", 100, consumername="doomed")

    found = wait_trajectories(db, len(jobs), logs=[survivor])
    wait_for(lambda: pending_jobs(db) == 0, "every job to be acked", logs=[survivor])
    counts = Counter(t.job_id for t in trajectories(db))
    assert set(counts) == {job.job_id for job in jobs}
    assert set(counts.values()) == {1}, counts
    assert len(found) == len(jobs)
    if orphans:  # the killed worker held jobs: the survivor took them over
        assert status(survivor)["reclaimed"] >= len(orphans)
    # The dead name holds nothing now: the survivor removes it from the group.
    wait_for(lambda: consumers(db) == {"survivor"}, "the dead consumer to be removed", logs=[survivor])


def test_a_poison_job_is_dead_lettered_after_max_deliveries_and_the_run_goes_on(
    db: redis.Redis,
    workers,
    engine: RunningServer,
    game_server: RunningServer,
    checkpoints,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The poison job kills every worker that takes it (SIGKILL from here, as the OOM killer
    would): three deliveries, three dead workers; the fourth worker parks it and plays the rest.

    The victims play it against a SIGSTOPped env server, so each holds it (pending) until it is
    killed: against a live one a fast machine plays the 4 turns between two polls of this test,
    acks it, and no worker is ever seen holding it (CI saw that)."""
    envs = {"game": game_server.url}
    poison, *healthy = make_jobs(5, max_turns=4)
    stalled = start_family_server("game", tmp_path_factory)
    stalled.process.send_signal(signal.SIGSTOP)
    try:
        publish(db, [poison])
        for victim in range(3):
            worker = workers(
                engine.url, {"game": stalled.url}, checkpoints[0], "--consumer", f"victim-{victim}"
            )
            wait_for(
                lambda name=f"victim-{victim}": held_by(db, name),
                f"victim-{victim} to take the poison job",
                logs=[worker],
            )
            worker.process.send_signal(signal.SIGKILL)
            worker.process.wait(timeout=10)
    finally:
        stalled.process.send_signal(signal.SIGCONT)
        stop_server(stalled.process)
    survivor = workers(engine.url, envs, checkpoints[0], "--consumer", "survivor")
    dead_letters = f"{KEYS.jobs}:dead"
    wait_for(lambda: db.xlen(dead_letters) == 1, "the poison job to be dead-lettered", logs=[survivor])
    ((_, parked),) = db.xrange(dead_letters)
    assert RolloutJob.model_validate_json(parked[b"data"]) == poison
    assert parked[b"dead:consumer"] == b"survivor"
    assert parked[b"dead:error"].startswith(b"delivered 3 times (max_deliveries 3)")
    publish(db, healthy)
    found = wait_trajectories(db, len(healthy), logs=[survivor])
    assert sorted(t.job_id for t in found) == sorted(job.job_id for job in healthy)
    wait_for(lambda: pending_jobs(db) == 0, "every job to be acked", logs=[survivor])
    wait_for(lambda: consumers(db) == {"survivor"}, "the victims to be removed", logs=[survivor])


def test_two_runs_sharing_a_redis_keep_their_jobs_and_trajectories_apart(
    db: redis.Redis, workers, engine: RunningServer, game_server: RunningServer, checkpoints
) -> None:
    other = RunKeys("other-run")
    envs = {"game": game_server.url}
    mine = workers(engine.url, envs, checkpoints[0], "--consumer", "mine")
    theirs = workers(engine.url, envs, checkpoints[0], "--consumer", "theirs", run=other)
    publish(db, make_jobs(4))
    publish(db, make_jobs(4, start=4, run=other), run=other)
    for run, worker in ((KEYS, mine), (other, theirs)):
        wait_for(
            lambda run=run: db.xlen(run.trajectories) >= 4, f"run {run.run_id}'s trajectories", logs=[worker]
        )
    wait_for(lambda: status(mine)["jobs_done"] == status(theirs)["jobs_done"] == 4, "both workers' counts")
    for run, consumer in ((KEYS, "mine"), (other, "theirs")):
        played = trajectories(db, run)
        assert {(t.run_id, t.worker_id) for t in played} == {(run.run_id, consumer)}
        assert len(played) == 4
    assert set(db.hkeys(KEYS.workers)) == {b"mine"} and set(db.hkeys(other.workers)) == {b"theirs"}


def consumers(db: redis.Redis) -> set[str]:
    return {c["name"].decode() for c in db.xinfo_consumers(KEYS.jobs, ROLLOUT_GROUP)}


def test_a_killed_engine_makes_the_worker_unhealthy_until_one_answers_again(
    db: redis.Redis, workers, game_server: RunningServer, checkpoints, tmp_path: Path
) -> None:
    """The worker's only engine is SIGKILLed mid-run and restarted on its port: /health says so
    meanwhile, the episodes wait for it, and every job ends with one trajectory and no error."""
    port = free_port()
    args = ["engine", "serve", "--model", str(checkpoints[0]), "--port", str(port), "--threads", "1"]
    engine = start_server(args, port, tmp_path, name="engine-first")
    worker = workers(engine.url, {"game": game_server.url}, checkpoints[0], "--concurrency", "4")
    jobs = make_jobs(12, max_turns=6)
    publish(db, jobs)
    wait_for(lambda: db.xlen(KEYS.trajectories) >= 2, "the first trajectories", logs=[worker])
    engine.process.send_signal(signal.SIGKILL)
    engine.process.wait(timeout=10)

    def health() -> httpx.Response:
        return POLL.get(f"{worker.url}/health", timeout=10)

    lost = wait_for(
        lambda: (answer := health()).status_code == 503 and answer, "/health to be 503", logs=[worker]
    )
    error = lost.json()["error"]
    assert error["code"] == "unhealthy" and error["message"].startswith("no engine answers")
    assert f"127.0.0.1:{port}" in error["message"]
    restarted = start_server(args, port, tmp_path, name="engine-second")
    try:
        wait_for(lambda: health().status_code == 200, "/health to recover", logs=[worker])
        found = wait_trajectories(db, len(jobs), logs=[worker])
        wait_for(lambda: pending_jobs(db) == 0, "every job to be acked", logs=[worker])
    finally:
        stop_server(restarted.process)
    assert Counter(t.job_id for t in found) == Counter(job.job_id for job in jobs)
    assert [t.error for t in found if t.error] == []
    assert f"engine http://127.0.0.1:{port}: back after" in worker.log()


def test_sigterm_stops_taking_jobs_and_loses_none(
    db: redis.Redis, workers, engine: RunningServer, game_server: RunningServer, checkpoints
) -> None:
    jobs = make_jobs(12, max_turns=10)
    envs = {"game": game_server.url}
    first = workers(engine.url, envs, checkpoints[0], "--concurrency", "4", "--shutdown-grace-s", "1")
    publish(db, jobs)
    wait_for(lambda: status(first)["in_flight"] > 0, "the worker to be mid-episode")
    first.process.send_signal(signal.SIGTERM)
    # A clean exit: uvicorn re-raises the signal once the lifespan shutdown has completed.
    assert first.process.wait(timeout=30) in (0, -signal.SIGTERM), first.log()
    assert "Application shutdown complete" in first.log()
    done_before = db.xlen(KEYS.trajectories)
    assert done_before < len(jobs)
    # What it did not finish is still pending (or undelivered): a second worker completes it.
    second = workers(engine.url, envs, checkpoints[0], "--concurrency", "4")
    wait_trajectories(db, len(jobs), logs=[second])
    wait_for(lambda: pending_jobs(db) == 0, "every job to be acked", logs=[second])
    counts = Counter(t.job_id for t in trajectories(db))
    assert set(counts) == {job.job_id for job in jobs} and set(counts.values()) == {1}


def test_policy_update_reloads_the_engines_and_tags_later_trajectories(
    db: redis.Redis,
    workers,
    game_server: RunningServer,
    checkpoints: tuple[Path, Path],
    redis_url: str,
    tmp_path: Path,
) -> None:
    """Two engines of its own (their weights change); the update lands while episodes run."""
    engines = [start_engine(checkpoints[0], tmp_path, "--threads", "1") for _ in range(2)]
    urls = [server.url for server in engines]
    try:
        for url in urls:
            assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "default"}
        envs = {"game": game_server.url}
        worker = workers(",".join(urls), envs, checkpoints[0], "--concurrency", "4")
        report = wait_for(lambda: (s := status(worker))["policy_version"] == 0 and s, "the engines' versions")
        assert [engine["url"] for engine in report["engines"]] == urls
        during = make_jobs(8, max_turns=10)
        publish(db, during)
        wait_for(lambda: status(worker)["in_flight"] > 0, "episodes in flight", logs=[worker])

        publish_policy(redis_url, 1, checkpoints[1])
        for url in urls:
            wait_for(
                lambda url=url: POLL.get(f"{url}/weight_info").json() == {"weight_version": "1"},
                f"{url} to serve v1",
                logs=[worker],
            )
        wait_for(lambda: status(worker)["policy_version"] == 1, "the worker to report v1", logs=[worker])
        after = make_jobs(4, start=8)
        publish(db, after)
        found = {t.job_id: t for t in wait_trajectories(db, 12, logs=[worker])}
        assert len(found) == 12
        for trajectory in found.values():
            # No episode straddles a reload: every turn was sampled under the episode's version.
            assert trajectory.error is None, trajectory.error
            assert {turn.policy_version for turn in trajectory.turns} == {trajectory.policy_version}
        assert {found[job.job_id].policy_version for job in after} == {1}
        report = status(worker)
        assert report["reloads"] == 2 and report["target_policy_version"] == 1
        assert [engine["policy_version"] for engine in report["engines"]] == [1, 1]

        # A worker that starts later finds the engines already on v1 and reloads nothing.
        late = workers(urls[0], envs, checkpoints[0])
        report = wait_for(lambda: (s := status(late))["target_policy_version"] == 1 and s, "the late worker")
        assert report["policy_version"] == 1 and report["reloads"] == 0
    finally:
        for server in engines:
            stop_server(server.process)


def test_a_worker_with_the_engine_in_its_process_plays_serves_the_protocol_and_reloads(
    db: redis.Redis,
    workers,
    game_server: RunningServer,
    checkpoints: tuple[Path, Path],
    redis_url: str,
) -> None:
    """``--engine-model``: episodes call the engine in the worker's process, whose protocol the
    worker serves under /engine (the URL it registers), where a policy update reloads it."""
    worker = workers(
        None,
        {"game": game_server.url},
        None,  # the tokenizer of --engine-model
        "--engine-model",
        str(checkpoints[0]),
        "--concurrency",
        "4",
        STARGYM_WEIGHTS_ROOTS=str(checkpoints[0].parent),
    )
    engine_url = f"{worker.url}/engine"
    report = wait_for(lambda: (s := status(worker))["policy_version"] == 0 and s, "the engine in the worker")
    assert [engine["url"] for engine in report["engines"]] == [engine_url]
    (card,) = httpx.get(f"{engine_url}/v1/models", timeout=10).json()["data"]
    assert card["root"] == str(checkpoints[0].resolve())
    assert httpx.get(f"{engine_url}/weight_info", timeout=10).json() == {"weight_version": "default"}

    before = make_jobs(6)
    publish(db, before)
    found = wait_trajectories(db, 6, logs=[worker])
    assert all(t.error is None and t.policy_version == 0 and sum(t.loss_mask) > 0 for t in found), found

    publish_policy(redis_url, 1, checkpoints[1])
    wait_for(
        lambda: POLL.get(f"{engine_url}/weight_info", timeout=10).json() == {"weight_version": "1"},
        "the engine in the worker to serve v1",
        logs=[worker],
    )
    after = make_jobs(4, start=6)
    publish(db, after)
    found = {t.job_id: t for t in wait_trajectories(db, 10, logs=[worker])}
    assert {found[job.job_id].policy_version for job in after} == {1}
    assert all(t.error is None for t in found.values())
    report = status(worker)
    assert report["reloads"] == 1 and report["jobs_done"] == 10
    sampled = sum(sum(t.loss_mask) for t in found.values())
    metrics = httpx.get(f"{engine_url}/metrics", timeout=10).text
    generated = float(re.search(r"^engine_generated_tokens_total (\S+)$", metrics, re.M).group(1))
    assert generated == sampled  # every token was sampled by the engine in the worker


def test_redis_going_away_is_waited_out(
    workers, engine: RunningServer, game_server: RunningServer, checkpoints, tmp_path: Path
) -> None:
    """A private Redis, stopped and restarted empty on its port: the worker logs, backs off, resumes."""
    server = start_redis_server()
    try:
        db = redis.Redis.from_url(server.url)
        worker = workers(engine.url, {"game": game_server.url}, checkpoints[0], REDIS_URL=server.url)
        publish(db, make_jobs(2))
        wait_trajectories(db, 2, logs=[worker])
        server.stop()
        wait_for(lambda: status(worker)["redis_errors"] >= 2, "the worker to see Redis down", logs=[worker])
        assert worker.process.poll() is None
        server = start_redis_server(server.port)  # nothing persisted: no stream, no group
        db = redis.Redis.from_url(server.url)
        later = make_jobs(2, start=2)
        publish(db, later)
        found = wait_trajectories(db, 2, logs=[worker])
        assert sorted(t.job_id for t in found) == sorted(job.job_id for job in later)
        assert all(t.error is None for t in found)
        wait_for(lambda: pending_jobs(db) == 0, "the jobs to be acked", logs=[worker])
        db.close()
    finally:
        server.stop()


async def test_reload_gate_waits_for_running_episodes_and_holds_new_ones() -> None:
    gate = ReloadGate()
    events: list[str] = []
    first_running = asyncio.Event()
    release_first = asyncio.Event()

    async def episode(name: str, started: asyncio.Event | None = None, release: asyncio.Event | None = None):
        async with gate.episode():
            events.append(f"{name} start")
            if started:
                started.set()
            if release:
                await release.wait()
            events.append(f"{name} end")

    async def reload() -> None:
        async with gate.exclusive():
            events.append("reload")

    first = asyncio.create_task(episode("a", first_running, release_first))
    await first_running.wait()
    reloading = asyncio.create_task(reload())
    await asyncio.sleep(0.01)
    assert gate.reloading and events == ["a start"]  # the reload waits for episode a
    second = asyncio.create_task(episode("b"))
    await asyncio.sleep(0.01)
    assert events == ["a start"]  # and episode b waits for the reload
    release_first.set()
    await asyncio.gather(first, reloading, second)
    assert events == ["a start", "a end", "reload", "b start", "b end"]
    assert not gate.reloading and gate.active == 0


async def test_a_cancelled_reload_releases_the_gate() -> None:
    gate = ReloadGate()
    hold = asyncio.Event()

    async def episode() -> None:
        async with gate.episode():
            await hold.wait()

    running = asyncio.create_task(episode())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(gate.exclusive().__aenter__())
    await asyncio.sleep(0.01)
    assert gate.reloading
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert not gate.reloading
    async with asyncio.timeout(1):
        async with gate.episode():  # new episodes are let in again
            pass
    hold.set()
    await running


def test_settings_read_flags_and_prefixed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://10.0.0.1:6379/2")
    monkeypatch.setenv("STARGYM_ROLLOUT_ENGINE_URLS", "http://a:8210/, http://b:8210")
    monkeypatch.setenv("STARGYM_ROLLOUT_ENV_URLS", "game=http://g:8101,search=http://s:8103")
    for name in ("STARGYM_CONCURRENCY", "CONCURRENCY", "TOKENIZER"):  # not ours: ignored
        monkeypatch.setenv(name, "3")
    monkeypatch.setenv("STARGYM_LOG_LEVEL", "info")  # shared by every service
    settings = WorkerSettings()
    assert settings.redis_url == "redis://10.0.0.1:6379/2"
    assert settings.engine_urls == ["http://a:8210", "http://b:8210"]
    assert settings.env_urls == {"game": ["http://g:8101"], "search": ["http://s:8103"]}
    assert (settings.concurrency, settings.tokenizer, settings.port) == (64, None, 8200)
    assert settings.log_level == "info"
    monkeypatch.setenv("STARGYM_PORT", "9000")
    assert WorkerSettings().port == 9000
    monkeypatch.setenv("STARGYM_ROLLOUT_PORT", "9001")  # the worker's own name wins
    monkeypatch.setenv("STARGYM_ROLLOUT_CONCURRENCY", "16")
    assert (WorkerSettings().port, WorkerSettings().concurrency) == (9001, 16)
    assert WorkerSettings(port=1, concurrency=2).port == 1
    assert settings.touch_every_s == settings.visibility_timeout_s / 3
    assert WorkerSettings(concurrency=5, env_urls=["web=http://w"]).env_urls == {"web": ["http://w"]}
    for bad in ("game", "game/frozenlake=http://g", "game=http://a,game=http://b"):
        with pytest.raises(ValueError):
            parse_family_urls(bad)
    with pytest.raises(ValueError):
        WorkerSettings(visibility_timeout_s=3, touch_interval_s=5)
    # An engine in the worker's process is its only engine, at its own URL: the configured are not used.
    in_worker = WorkerSettings(
        engine_model="models/tiny", host="0.0.0.0", advertise_url="http://rollout:8200"
    )
    assert in_worker.engine_endpoints == ["http://rollout:8200/engine"]
    assert settings.engine_endpoints == settings.engine_urls


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine-model", "models/tiny", "--engine-url", "http://127.0.0.1:1"], "give one"),
        (
            ["--engine-model", "/nonexistent/model"],
            "'/nonexistent/model' is not a Hugging Face model directory",
        ),
    ],
)
def test_rollout_with_an_engine_model_it_cannot_use_says_why(flags: list[str], message: str) -> None:
    """Exit 2 naming --engine-model, before anything is loaded; no traceback."""
    result = subprocess.run(
        [*STARGYM, "rollout", *flags, "--env", "game=http://127.0.0.1:1"],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--engine-model" in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_rollout_without_a_tokenizer_it_cannot_find_says_to_pass_one() -> None:
    """No --tokenizer and no engine to ask: exit 2 with a message naming --tokenizer, no traceback."""
    dead = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [*STARGYM, "rollout", "--engine-url", dead, "--env", "game=http://127.0.0.1:1"],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "200", "STARGYM_ROLLOUT_TOKENIZER": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "pass --tokenizer DIR" in result.stderr and "Traceback" not in result.stderr
