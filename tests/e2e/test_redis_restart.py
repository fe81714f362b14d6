"""Take Redis away from a running system and give it back: the run goes on and nothing in Redis is lost.

The whole system runs as processes (``deploy.up.bring_up``: env server, CPU engine, rollout worker,
trainer) on a Redis of this test's own, which persists to an append-only file in its own directory,
as the compose file's Redis does. Redis is shut down with SIGTERM (so it writes its data) at a
moment made deterministic with SIGSTOP: the worker is in the middle of episodes, and the trainer
has just read a full batch, so it is in the middle of an update whose policy it must publish.
Redis stays down for several of the services' backoff steps, then starts again on the same port
and directory. Then:

* what the run had in Redis when it stopped is all there again, byte for byte: every stream entry
  (jobs and trajectories waiting, pending or dead-lettered), the consumer groups and what is pending
  on whom, the policy, the workers registry and the dedup keys. The services are frozen while the
  state is read, and the persisted copy is read by a second server started on the same directory
  on another port, where no service can change it;
* while Redis is down, the worker's ``/health`` is a 503 naming Redis (not ready, but alive) and
  its finished episodes wait to be published; the trainer has finished its update and waits to
  publish the policy; no process exits;
* after the restart, every job Redis held gets its trajectory, the trainer publishes and goes on
  updating, and the worker is healthy again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import POLL, REPO_ROOT, RunningServer, free_port, short_run_overrides, wait_until

from deploy.redis_local import LocalRedis, start_redis_server
from deploy.up import Stack, bring_up
from services.rollout_protocol import DATA_FIELD, ROLLOUT_GROUP, TRAINER_GROUP, RolloutJob, RunKeys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(8 * 60)]

CONFIG = REPO_ROOT / "configs/frozenlake-tiny.yaml"
RUN = "e2e-redis-restart"
GROUP_SIZE, GROUPS_PER_BATCH = 4, 4
"""What ``short_run_overrides`` sets: a batch is 4 complete groups of 4."""
DEADLINE_S = 180.0
CONCURRENCY = 8
"""Episodes the worker plays at once: a batch is two rounds of it."""
PILE = GROUP_SIZE * (GROUPS_PER_BATCH + 6)
"""Jobs let pile up for the worker: a batch, and three rounds still to play once it is played. With
one round (a pile of 24) the worker sometimes played it all before the test's poll saw the batch
(1-token replies: a round is one engine step), and no job was in flight when Redis stopped."""
OUTAGE_S = 6.0
"""How long Redis stays down: several backoff steps of every service (the worker's start at 0.5 s,
the trainer's at 0.2 s, both doubling)."""


def get_json(url: str, path: str) -> tuple[int, Any] | None:
    """``(status, JSON body)`` of ``GET url+path``, or None if the service does not answer."""
    try:
        response = POLL.get(f"{url}{path}", timeout=2.0)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError):
        return None


def status(service: RunningServer) -> dict | None:
    answer = get_json(service.url, "/status")
    return answer[1] if answer is not None and answer[0] == 200 else None


def all_alive(stack: Stack) -> None:
    """Fail at once, with its log, if any process of the stack has exited."""
    for service in stack.services:
        if service.process.poll() is not None:
            raise AssertionError(
                f"{service.name} exited with {service.process.returncode}:\n{service.log()[-6000:]}"
            )


def wait_for(stack: Stack, service: RunningServer, predicate, what: str) -> dict:
    """``service``'s /status once ``predicate`` holds for it; fails at once if a process exits."""

    def satisfied() -> dict | None:
        all_alive(stack)
        current = status(service)
        return current if current is not None and predicate(current) else None

    return wait_until(satisfied, what, deadline_s=DEADLINE_S, interval_s=0.2, logs=stack.services)


def run_state(url: str, keys: RunKeys) -> dict[str, Any]:
    """Every key of the run, read whole: stream entries, groups, pending entries, hashes, strings.

    Idle times and the Redis 7 ``entries-read``/``lag`` counters are left out: the first change
    by the second, and a reloaded server recounts the others.
    """
    client = redis.Redis.from_url(url)
    try:
        state: dict[str, Any] = {}
        for key in sorted(client.scan_iter(match=f"{keys.prefix}*", count=1000)):
            kind = client.type(key)
            if kind == b"stream":
                groups = client.xinfo_groups(key)
                state[key] = {
                    "entries": client.xrange(key),
                    "groups": sorted((g["name"], g["pending"], g["last-delivered-id"]) for g in groups),
                    "pending": {
                        g["name"]: [
                            (p["message_id"], p["consumer"], p["times_delivered"])
                            for p in client.xpending_range(key, g["name"], "-", "+", 100_000)
                        ]
                        for g in groups
                    },
                }
            elif kind == b"hash":
                state[key] = client.hgetall(key)
            elif kind == b"string":
                state[key] = client.get(key)
            else:
                state[key] = kind  # nothing else is expected; a new kind shows in the comparison
        return state
    finally:
        client.close()


def pause(*services: RunningServer) -> None:
    for service in services:
        os.kill(service.process.pid, signal.SIGSTOP)


def resume(*services: RunningServer) -> None:
    for service in services:
        os.kill(service.process.pid, signal.SIGCONT)


def unread_trajectories(client: redis.Redis, keys: RunKeys) -> list[dict[str, Any]]:
    """The trajectories in the stream that the trainer's group has not been handed yet."""
    (group,) = [g for g in client.xinfo_groups(keys.trajectories) if g["name"] == TRAINER_GROUP.encode()]
    after = b"(" + group["last-delivered-id"]
    return [
        json.loads(fields[DATA_FIELD.encode()]) for _, fields in client.xrange(keys.trajectories, min=after)
    ]


def complete_groups(client: redis.Redis, keys: RunKeys) -> int:
    """Complete groups among the unread trajectories (the trainer trains every one, whatever its age)."""
    unread = unread_trajectories(client, keys)
    return sum(count == GROUP_SIZE for count in Counter(t["group_id"] for t in unread).values())


def undelivered_jobs(client: redis.Redis, keys: RunKeys) -> int:
    """Jobs in the stream that no worker has been handed yet."""
    (group,) = [g for g in client.xinfo_groups(keys.jobs) if g["name"] == ROLLOUT_GROUP.encode()]
    return len(client.xrange(keys.jobs, min=b"(" + group["last-delivered-id"]))


def pending_jobs(client: redis.Redis, keys: RunKeys) -> int:
    return int(client.xpending(keys.jobs, ROLLOUT_GROUP)["pending"])


def pending_count(state: dict[str, Any], stream: str) -> int:
    return sum(len(entries) for entries in state[stream.encode()]["pending"].values())


def job_ids(state: dict[str, Any], keys: RunKeys) -> set[str]:
    entries = state[keys.jobs.encode()]["entries"]
    return {RolloutJob.model_validate_json(fields[DATA_FIELD.encode()]).job_id for _, fields in entries}


def stop_mid_update(stack: Stack, server: LocalRedis, keys: RunKeys) -> dict[str, Any]:
    """Stop Redis while the worker plays episodes and the trainer updates on a batch it just read;
    returns the run's state in Redis at that moment.

    The worker is frozen until jobs pile up for it; then the trainer is frozen and the worker let
    go until it has published a batch the trainer has not read, and frozen again with the rest of
    the pile in flight; then the trainer is let go until it has read the batch (it starts the
    update at once, which takes far longer than this test's poll), and frozen too. Both are let
    go once Redis is down.
    """
    worker, trainer = stack.worker, stack.trainer
    client = redis.Redis.from_url(server.url)
    try:
        pause(worker)
        wait_until(
            lambda: undelivered_jobs(client, keys) >= PILE,
            f"{PILE} jobs waiting for the frozen worker",
            deadline_s=DEADLINE_S,
            logs=[trainer],
        )
        pause(trainer)
        resume(worker)
        wait_until(
            lambda: complete_groups(client, keys) >= GROUPS_PER_BATCH,
            "a batch for the frozen trainer",
            deadline_s=DEADLINE_S,
            interval_s=0.005,
            logs=[worker],
        )
        pause(worker)
        assert pending_jobs(client, keys) > 0, "the worker played the whole pile before it was frozen"
        resume(trainer)
        wait_until(
            lambda: not unread_trajectories(client, keys),
            "the trainer to read the batch",
            deadline_s=30.0,
            interval_s=0.002,
            logs=[trainer],
        )
        pause(trainer)
        state = run_state(server.url, keys)
        server.stop()  # SIGTERM: Redis appends what it has and exits
        return state
    finally:
        client.close()
        resume(worker, trainer)


def outlast(stack: Stack, since: float, seconds: float) -> None:
    """Wait until ``seconds`` have passed since ``since``, failing at once if a process exits."""
    wait_until(
        lambda: all_alive(stack) or time.monotonic() - since >= seconds,
        f"{seconds} s of outage",
        deadline_s=seconds + 5.0,
    )


def test_a_run_goes_on_after_redis_is_restarted_and_loses_nothing(tmp_path: Path) -> None:
    keys = RunKeys(RUN)
    data_dir = tmp_path / "redis-data"
    server = start_redis_server(data_dir=data_dir)
    overrides = [
        *short_run_overrides(tmp_path, RUN),
        f"dashboard.port={free_port()}",
        "optim.total_steps=1000",
        "rollout.max_inflight=96",  # room for the pile beside what the trainer holds,
        "rollout.max_staleness=5",  # which this admits: 6 batches of 16 jobs
    ]
    try:
        with bring_up(
            CONFIG, overrides, concurrency=CONCURRENCY, redis_url=server.url, private=True
        ) as stack:
            worker, trainer = stack.worker, stack.trainer
            wait_for(stack, trainer, lambda s: s["step"] >= 2, "two updates")

            before = stop_mid_update(stack, server, keys)
            down_since = time.monotonic()
            assert pending_count(before, keys.jobs) > 0
            assert pending_count(before, keys.trajectories) >= GROUP_SIZE * GROUPS_PER_BATCH
            with start_redis_server(data_dir=data_dir) as copy:  # another port: no service sees it
                assert run_state(copy.url, keys) == before

            # Down: the trainer has updated and cannot publish; the worker cannot publish either.
            stalled = wait_for(
                stack, trainer, lambda s: s["step"] == s["policy_version"] + 1, "an update waiting for Redis"
            )
            wait_for(
                stack,
                worker,
                lambda s: s["redis_errors"] > 0 and s["in_flight"] > 0,
                "episodes waiting for Redis",
            )
            health = get_json(worker.url, "/health")
            assert health is not None and health[0] == 503, health
            assert health[1]["error"]["code"] == "unhealthy"
            assert health[1]["error"]["message"].startswith("Redis does not answer"), health
            outlast(stack, down_since, OUTAGE_S)
            waiting = status(trainer)
            assert waiting["state"] == "training" and waiting["error"] is None, waiting
            assert (waiting["step"], waiting["policy_version"]) == (
                stalled["step"],
                stalled["policy_version"],
            )

            server = start_redis_server(server.port, data_dir=data_dir)
            wait_for(
                stack,
                trainer,
                lambda s: s["policy_version"] >= stalled["step"] + 2,
                f"two more updates after {time.monotonic() - down_since:.0f} s without Redis",
            )
            client = redis.Redis.from_url(server.url)
            try:
                held = job_ids(before, keys)
                wait_until(
                    lambda: all(client.exists(keys.done(job)) for job in held),
                    "a trajectory for every job Redis held at the stop",
                    deadline_s=DEADLINE_S,
                    logs=stack.services,
                )
            finally:
                client.close()
            wait_until(
                lambda: (get_json(worker.url, "/health") or (0,))[0] == 200,
                "the worker to be healthy again",
                deadline_s=30.0,
                logs=[worker],
            )
            all_alive(stack)
    finally:
        server.stop()
