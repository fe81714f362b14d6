"""The trainer's controller against a real Redis: issuing, grouping, staleness, StarPO-S, acks.

Trajectories are published by the test itself (as a rollout worker would), so every case is
exact and fast; the whole system with real workers is tested in tests/e2e/.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from services.queue import connect, job_queue, trajectory_queue
from services.rollout_protocol import RolloutJob, Trajectory, Turn
from trainer.config import TrainConfig
from trainer.controller import Controller, read_controller_log, shape_reward


def make_config(**rollout: object) -> TrainConfig:
    data = {
        "run": {"name": "ctl", "seed": 3},
        "envs": {"mix": [{"id": "game/frozenlake"}], "train_seeds": [100, 200], "eval_seeds": [0, 10]},
        "rollout": {"group_size": 2, "groups_per_batch": 2, "max_inflight": 8, "max_staleness": 1, **rollout},
        "curriculum": {"horizon_schedule": [[0, 4], [2, 6]]},
    }
    return TrainConfig.from_dict(data)


def trajectory(job: RolloutJob, reward: float, version: int = 0, **extra: object) -> Trajectory:
    turn = Turn(
        observation="o",
        response="Left",
        actions=["Left"],
        reward=reward,
        done=True,
        valid=True,
        policy_version=version,
        prompt_tokens=1,
        response_tokens=1,
    )
    fields = {
        "worker_id": "test",
        "turns": [turn],
        "token_ids": [1, 2],
        "loss_mask": [0, 1],
        "logprobs": [0.0, -1.0],
        "reward": reward,
        "num_turns": 1,
        "policy_version": version,
    }
    return Trajectory.from_job(job, **{**fields, **extra})


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    sync = redis.Redis.from_url(redis_url)
    sync.flushdb()
    sync.close()
    conn = connect(redis_url)
    yield conn
    await conn.aclose()


async def issued_jobs(conn: redis.asyncio.Redis, count: int) -> list[RolloutJob]:
    jobs = job_queue(conn)
    deliveries = await jobs.consume("test-worker", count=count, block_ms=2000)
    await jobs.ack([d.entry_id for d in deliveries])
    return [d.model for d in deliveries]


async def test_issues_groups_up_to_max_inflight(client: redis.asyncio.Redis, tmp_path: Path) -> None:
    controller = Controller(make_config(), client, run_dir=tmp_path)
    await controller.start()
    try:
        jobs = await issued_jobs(client, 100)
        assert len(jobs) == 8  # max_inflight
        groups: dict[str, list[RolloutJob]] = {}
        for job in jobs:
            groups.setdefault(job.group_id, []).append(job)
        assert len(groups) == 4 and all(len(members) == 2 for members in groups.values())
        for members in groups.values():
            assert len({job.seed for job in members}) == 1
            assert len({job.sampling.seed for job in members}) == 2
        assert sorted(job.seed for job in jobs) == [100, 100, 101, 101, 102, 102, 103, 103]
        assert {job.max_turns for job in jobs} == {4}
        assert {job.policy_version for job in jobs} == {0}
        assert controller.outstanding == 8
    finally:
        await controller.close()


async def test_batches_complete_groups_drops_stale_and_untrainable_acks_on_commit(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    controller = Controller(make_config(max_inflight=10), client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client)
    try:
        jobs = await issued_jobs(client, 100)
        groups = [jobs[i : i + 2] for i in range(0, 10, 2)]
        # group 0: fresh; group 1: one member failed; group 2: fresh; group 3: half played.
        for job, reward in zip(groups[0], (0.0, 1.0), strict=True):
            await trajectories.publish(trajectory(job, reward))
        await trajectories.publish(trajectory(groups[1][0], 1.0))
        await trajectories.publish(trajectory(groups[1][1], 0.0, error="env error: boom"))
        for job in groups[2]:
            await trajectories.publish(trajectory(job, 0.5))
        await trajectories.publish(trajectory(groups[3][0], 0.5))
        batch = await controller.next_batch(timeout_s=10)
        assert [g.group_id for g in batch.groups] == [groups[0][0].group_id, groups[2][0].group_id]
        assert batch.kept_ratio == 1.0
        assert controller.counters["dropped_untrainable"] == 2
        assert await trajectories.pending_count() == 7  # nothing acked before the checkpoint
        assert await controller.commit(step=1) == 6  # used (4) and dropped (2)
        assert await trajectories.pending_count() == 1  # the half-played group waits

        # Version 3 now: a group sampled under version 1 is more than max_staleness=1 behind.
        controller.set_progress(step=3, policy_version=3)
        await trajectories.publish(trajectory(groups[3][1], 0.5, version=1))
        for job in groups[4]:
            await trajectories.publish(trajectory(job, 1.0, version=2))
        more = await issued_jobs(client, 100)  # issued as soon as the first batch freed slots
        later = controller.make_group_jobs(99)
        assert {job.max_turns for job in later} == {6}  # the horizon schedule's second stage
        assert {job.policy_version for job in later} == {3}
        for job in more[:2]:
            await trajectories.publish(trajectory(job, 0.0, version=3))
        batch = await controller.next_batch(timeout_s=10)
        assert controller.counters["dropped_stale"] == 2
        assert [g.group_id for g in batch.groups] == [groups[4][0].group_id, more[0].group_id]
    finally:
        await controller.close()
    events = [record["event"] for record in read_controller_log(tmp_path)]
    assert {"start", "issue", "consume", "drop", "commit"} <= set(events)


async def test_starpo_s_keeps_the_highest_std_groups(client: redis.asyncio.Redis, tmp_path: Path) -> None:
    config = make_config(max_inflight=8)
    config.starpo_s.filter.enabled = True
    config.starpo_s.filter.ratio = 0.5
    controller = Controller(config, client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client)
    try:
        jobs = await issued_jobs(client, 100)
        rewards = [(0.0, 0.0), (0.0, 1.0), (0.5, 0.5), (0.0, 0.5)]
        for index, pair in enumerate(rewards):
            for job, reward in zip(jobs[2 * index : 2 * index + 2], pair, strict=True):
                await trajectories.publish(trajectory(job, reward))
        batch = await controller.next_batch(timeout_s=10)
        assert batch.candidates == 4 and batch.kept_ratio == 0.5
        assert [g.group_id for g in batch.groups] == [jobs[2].group_id, jobs[6].group_id]
        assert controller.counters["groups_filtered"] == 2
        assert controller.outstanding == 0  # filtered groups free their slots: more are issued
    finally:
        await controller.close()


async def test_a_restarted_controller_rereads_what_was_not_committed(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    first = Controller(make_config(max_inflight=4), client, run_dir=tmp_path)
    await first.start()
    trajectories = trajectory_queue(client)
    jobs = await issued_jobs(client, 100)
    for job in jobs:
        await trajectories.publish(trajectory(job, float(job.job_id.endswith("0"))))
    batch = await first.next_batch(timeout_s=10)
    assert len(batch.trajectories) == 4
    await first.close()  # "crashed" before the checkpoint: nothing committed

    second = Controller(make_config(max_inflight=4), client, run_dir=tmp_path)
    await second.start(first.state_dict(), step=1, policy_version=1)
    try:
        assert second.counters["reclaimed"] == 4
        again = await second.next_batch(timeout_s=10)
        assert sorted(t.job_id for t in again.trajectories) == sorted(job.job_id for job in jobs)
        assert await second.commit(step=1) == 4
        assert await trajectories.pending_count() == 0
        # Groups continue where the first lifetime's state left off, under new ids.
        fresh = await issued_jobs(client, 100)
        assert min(job.seed for job in fresh) == 102
        assert not {job.job_id for job in fresh} & {job.job_id for job in jobs}
    finally:
        await second.close()


def test_invalid_turns_are_penalised() -> None:
    job = RolloutJob(run_id="r", env="game/frozenlake", seed=1, group_id="g", max_turns=4, policy_version=0)
    base = trajectory(job, 1.0)
    bad = base.turns[0].model_copy(update={"valid": False, "done": False, "reward": 0.0})
    invalid = base.model_copy(update={"turns": [bad, base.turns[0]], "num_turns": 2, "max_turns": 4})
    shaped = shape_reward(invalid, -0.5)  # one turn of two invalid: -0.5 x 1/2
    assert shaped.reward == pytest.approx(0.75) and shaped.turns[0].reward == pytest.approx(-0.25)
    assert shape_reward(base, -0.1) is base
