"""The trainer's controller against a real Redis: issuing, grouping, admission by staleness, StarPO-S, acks.

Trajectories are published by the test itself (as a rollout worker would), so every case is
exact and fast; the whole system with real workers is tested in tests/e2e/.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from conftest import eventually

from services.queue import connect, job_queue, trajectory_queue
from services.rollout_protocol import RolloutJob, RunKeys, Trajectory, Turn
from trainer import controller as controller_module
from trainer.audit_log import RotatingJsonl
from trainer.config import TrainConfig
from trainer.controller import Controller, read_controller_log, shape_reward

KEYS = RunKeys("ctl")
"""The Redis names of :func:`make_config`'s run."""


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
    jobs = job_queue(conn, KEYS)
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


async def test_batches_complete_groups_oldest_first_trains_stale_ones_drops_untrainable_acks_on_commit(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    controller = Controller(make_config(max_inflight=10, max_staleness=2), client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client, KEYS)
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

        # Version 3 now. Two newer groups complete first, then group 3, begun under version 0: a
        # long episode, 3 versions behind (max_staleness 2). It is the oldest, so it goes first,
        # and it is trained, not dropped.
        controller.set_progress(step=3, policy_version=3)
        for job in groups[4]:
            await trajectories.publish(trajectory(job, 1.0, version=2))
        more = await issued_jobs(client, 100)  # issued as soon as the first batch freed slots
        later = controller.make_group_jobs(99)
        assert {job.max_turns for job in later} == {6}  # the horizon schedule's second stage
        assert {job.policy_version for job in later} == {3}
        for job in more[:2]:
            await trajectories.publish(trajectory(job, 0.0, version=3))
        await trajectories.publish(trajectory(groups[3][1], 0.5, version=1))

        async def three_ready() -> bool:
            return (await controller.queue_metrics())["system/ready_groups"] == 3

        await eventually(three_ready, "three complete groups")
        batch = await controller.next_batch(timeout_s=10)
        assert [g.group_id for g in batch.groups] == [groups[3][0].group_id, groups[4][0].group_id]
        assert controller.counters["trained_stale"] == 2  # group 3's two; group 4 is 1 version old
        assert "dropped_stale" not in controller.counters
    finally:
        await controller.close()
    events = [record["event"] for record in read_controller_log(tmp_path)]
    assert {"start", "issue", "group", "drop", "batch", "commit"} <= set(events)


async def test_max_staleness_admits_that_many_batches_ahead_and_no_more(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    # max_inflight 8 has room for 4 groups of 2; max_staleness 0 admits one batch (2 groups) only:
    # the next is issued when that one has been cut, so every trajectory is fresh.
    config = make_config(max_inflight=8, max_staleness=0)
    assert (config.staleness_limit, config.issue_limit) == (4, 4)
    controller = Controller(config, client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client, KEYS)
    try:
        jobs = await issued_jobs(client, 100)
        assert len(jobs) == 4 and controller.outstanding == 4
        assert await issued_jobs(client, 100) == []  # nothing more while they are out
        for job in jobs:
            await trajectories.publish(trajectory(job, 1.0))
        await controller.next_batch(timeout_s=10)
        controller.set_progress(step=1, policy_version=1)
        more = await issued_jobs(client, 100)
        assert len(more) == 4
    finally:
        await controller.close()
    assert make_config(max_staleness=3).issue_limit == 8  # max_inflight is the tighter bound there


async def test_starpo_s_keeps_the_highest_std_groups(client: redis.asyncio.Redis, tmp_path: Path) -> None:
    config = make_config(max_inflight=8)
    config.starpo_s.filter.enabled = True
    config.starpo_s.filter.ratio = 0.5
    controller = Controller(config, client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client, KEYS)
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
    trajectories = trajectory_queue(client, KEYS)
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


async def test_a_run_without_workers_says_which_runs_have_them(
    client: redis.asyncio.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The trainer of run ``ctl`` and a worker started for another run: nothing would ever come."""
    monkeypatch.setattr("trainer.controller.STALL_CHECK_S", 0.5)
    await client.hset(RunKeys("other-run").workers, "w1", "{}")
    controller = Controller(make_config(), client, run_dir=tmp_path)
    with caplog.at_level("WARNING", logger="trainer.controller"):
        await controller.start()
        try:

            async def warned() -> bool:
                return any("no rollout worker serves run 'ctl'" in r.message for r in caplog.records)

            await eventually(warned, "the stall warning", deadline_s=10)
        finally:
            await controller.close()
    (message,) = {r.message for r in caplog.records if "no rollout worker" in r.message}
    assert "workers serve other runs: other-run" in message and "--run ctl" in message
    # A worker of this run registered: the warning stops.
    caplog.clear()
    await client.hset(KEYS.workers, "w2", "{}")
    controller = Controller(make_config(), client, run_dir=tmp_path)
    with caplog.at_level("WARNING", logger="trainer.controller"):
        await controller.start()
        try:
            await asyncio.sleep(1.5)
        finally:
            await controller.close()
    assert not [r for r in caplog.records if "no rollout worker" in r.message]


def test_invalid_turns_are_penalised() -> None:
    job = RolloutJob(run_id="r", env="game/frozenlake", seed=1, group_id="g", max_turns=4, policy_version=0)
    base = trajectory(job, 1.0)
    bad = base.turns[0].model_copy(update={"valid": False, "done": False, "reward": 0.0})
    invalid = base.model_copy(update={"turns": [bad, base.turns[0]], "num_turns": 2, "max_turns": 4})
    shaped = shape_reward(invalid, -0.5)  # one turn of two invalid: -0.5 x 1/2
    assert shaped.reward == pytest.approx(0.75) and shaped.turns[0].reward == pytest.approx(-0.25)
    assert shape_reward(base, -0.1) is base


def test_a_multi_action_turn_is_penalised_for_the_share_of_its_actions_the_env_rejected() -> None:
    job = RolloutJob(run_id="r", env="game/frozenlake", seed=1, group_id="g", max_turns=4, policy_version=0)
    base = trajectory(job, 1.0)
    words = {"actions": ["Left", "Jump", "Fly", "Down"], "valid": False, "done": False, "reward": 0.0}
    partly = base.turns[0].model_copy(update={**words, "invalid_actions": 2})
    wholly = base.turns[0].model_copy(update={**words, "invalid_actions": 4})
    shaped = shape_reward(base.model_copy(update={"turns": [partly, base.turns[0]], "num_turns": 2}), -0.5)
    # -0.5 / 2 turns, for half the first turn's actions: the reply with more valid moves earns more.
    assert shaped.turns[0].reward == pytest.approx(-0.125) and shaped.reward == pytest.approx(0.875)
    worse = shape_reward(base.model_copy(update={"turns": [wholly, base.turns[0]], "num_turns": 2}), -0.5)
    assert worse.reward == pytest.approx(0.75) and worse.reward < shaped.reward


@contextlib.asynccontextmanager
async def worker_answering(conn: redis.asyncio.Redis) -> AsyncIterator[None]:
    """Play every job as a rollout worker would (reward 1 for even members) while the block runs.

    It is stopped by a flag, not by cancelling: a task cancelled inside a blocking Redis read can
    hang in redis-py's cleanup.
    """
    jobs = job_queue(conn, KEYS)
    trajectories = trajectory_queue(conn, KEYS)
    stop = asyncio.Event()

    async def play() -> None:
        while not stop.is_set():
            deliveries = await jobs.consume("test-worker", count=256, block_ms=100)
            if deliveries:
                played = [
                    trajectory(d.model, float(d.model.job_id[-1] in "02468"), d.model.policy_version)
                    for d in deliveries
                ]
                await trajectories.publish_many(played)
                await jobs.ack([d.entry_id for d in deliveries])

    task = asyncio.create_task(play())
    try:
        yield
    finally:
        stop.set()
        await task


async def test_starpo_s_with_default_sizes_gets_its_batch(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    # The regression: 16 kept groups at ratio 0.25 need 64 complete groups of 8 (512 jobs) at once,
    # and the in-flight limit used to stop at 256, so next_batch waited forever.
    config = TrainConfig.from_dict(
        {"preset": "starpo_s", "run": {"name": KEYS.run_id}, "envs": {"mix": [{"id": "game/bandit"}]}}
    )
    controller = Controller(config, client, run_dir=tmp_path)
    await controller.start()
    try:
        async with worker_answering(client):
            batch = await controller.next_batch(timeout_s=60)
        assert batch.candidates == 64 and len(batch.groups) == 16 and batch.kept_ratio == 0.25
    finally:
        await controller.close()


def timeout_config(timeout_s: float) -> TrainConfig:
    return make_config(groups_per_batch=1, max_inflight=2, group_timeout_s=timeout_s)


async def test_a_group_never_answered_is_reissued_once_then_dropped(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    controller = Controller(timeout_config(0.5), client, run_dir=tmp_path)
    await controller.start()
    try:
        first = await issued_jobs(client, 10)  # taken by a worker that then died: never answered
        assert len(first) == 2 and controller.outstanding == 2
        again = await eventually(lambda: issued_jobs(client, 10), "the re-issue", deadline_s=10)
        assert [job.job_id for job in again] == [f"{job.job_id}-r1" for job in first]
        assert [(j.group_id, j.seed, j.sampling.seed, j.max_turns) for j in again] == [
            (j.group_id, j.seed, j.sampling.seed, j.max_turns) for j in first
        ]
        assert controller.counters["groups_reissued"] == 1
        # Never answered either: the group is dropped, counted, and its slots go to a new group.
        fresh = await eventually(lambda: issued_jobs(client, 10), "a new group", deadline_s=10)
        assert controller.counters["groups_timed_out"] == 1
        assert {job.seed for job in fresh} == {101} and fresh[0].group_id != first[0].group_id
        assert controller.outstanding == 2
        # A member of the dropped group that turns up late is counted and never trained on.
        await trajectory_queue(client, KEYS).publish(trajectory(first[0], 1.0))
        for job in fresh:
            await trajectory_queue(client, KEYS).publish(trajectory(job, float(job.job_id.endswith("0"))))
        batch = await controller.next_batch(timeout_s=10)
        assert {t.job_id for t in batch.trajectories} == {job.job_id for job in fresh}
        assert controller.counters["late"] == 1
        assert await controller.commit(step=1) == 3  # the late one is acked too
    finally:
        await controller.close()
    drops = [r for r in read_controller_log(tmp_path) if r["event"] == "drop"]
    assert [d["kind"] for d in drops] == ["timed_out"]


async def test_a_lost_member_is_reissued_and_completes_its_group(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    controller = Controller(timeout_config(0.5), client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client, KEYS)
    try:
        kept, lost = await issued_jobs(client, 10)
        await trajectories.publish(trajectory(kept, 1.0))
        (again,) = await eventually(lambda: issued_jobs(client, 10), "the re-issue", deadline_s=10)
        assert again.job_id == f"{lost.job_id}-r1" and again.sampling.seed == lost.sampling.seed
        await trajectories.publish(trajectory(again, 0.0))
        batch = await controller.next_batch(timeout_s=10)
        assert [t.job_id for t in batch.trajectories] == [kept.job_id, again.job_id]
        # The original turns up after all: its group was used already, so it is acked unused.
        await trajectories.publish(trajectory(lost, 0.5))
        await eventually(lambda: _async(controller.counters["late"] == 1), "the late original")
        assert controller.counters["groups_timed_out"] == 0
        assert await controller.commit(step=1) == 3
    finally:
        await controller.close()


async def _async(value: object) -> object:
    return value


def test_the_audit_log_rotates_and_reads_back_across_files(tmp_path: Path) -> None:
    log = RotatingJsonl(tmp_path / "controller.jsonl", max_bytes=200, keep=2)
    for index in range(40):
        log.write({"event": "issue", "index": index})
    log.close()
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["controller.jsonl", "controller.jsonl.1", "controller.jsonl.2"]
    assert all(path.stat().st_size < 200 + 40 for path in tmp_path.iterdir())
    indices = [record["index"] for record in read_controller_log(tmp_path)]
    assert indices == list(range(indices[0], 40)) and indices[0] > 0  # oldest rotations deleted
    (tmp_path / "controller.jsonl").open("a").write('{"event": "torn')
    assert [record["index"] for record in read_controller_log(tmp_path)] == indices


async def test_batches_are_logged_by_job_id_and_the_log_stays_small(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    controller = Controller(make_config(max_inflight=4), client, run_dir=tmp_path)
    await controller.start()
    used = []
    try:
        async with worker_answering(client):
            for step in range(1, 4):
                batch = await controller.next_batch(timeout_s=10)
                used.append([t.job_id for t in batch.trajectories])
                controller.set_progress(step, step)
                await controller.commit(step)
    finally:
        await controller.close()
    records = read_controller_log(tmp_path)
    batches = [r for r in records if r["event"] == "batch"]
    assert [b["step"] for b in batches] == [1, 2, 3]
    assert [b["job_ids"] for b in batches] == used
    # Lines grow with groups and updates, not with trajectories: issue + group per group, batch
    # + commit per update, and the start.
    groups = sum(r["event"] == "issue" for r in records)
    assert len(records) <= 2 * groups + 2 * 3 + 1


async def test_a_stalled_batch_says_why_in_the_log(
    client: redis.asyncio.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No worker, engines stuck on an old policy, every episode failing: the trainer says which,
    not only counts."""
    monkeypatch.setattr(controller_module, "STALL_WARNING_S", 0.5)
    controller = Controller(make_config(max_inflight=4), client, run_dir=tmp_path)
    await controller.start()
    trajectories = trajectory_queue(client, KEYS)
    try:
        with caplog.at_level("WARNING", logger="trainer.controller"):
            with pytest.raises(TimeoutError):
                await controller.next_batch(timeout_s=1.5)
            assert "4 jobs issued and not back" in caplog.text
            caplog.clear()
            # Engines stuck on v0 while the policy is v3: trained (never dropped), and said.
            controller.set_progress(step=3, policy_version=3)
            for job in await issued_jobs(client, 100):
                await trajectories.publish(trajectory(job, 1.0, version=0))
            batch = await controller.next_batch(timeout_s=10)
        assert len(batch.trajectories) == 4 and controller.counters["trained_stale"] == 4
        stale = [r.message for r in caplog.records if "versions old" in r.message]
        assert stale and "trained 3 versions old (max_staleness 1)" in stale[0], caplog.text
        assert "engines not serving new policies" in stale[0]
        caplog.clear()
        with caplog.at_level("WARNING", logger="trainer.controller"):
            # Every episode fails (an env server that errors on every step): the trainer says so.
            jobs = await issued_jobs(client, 100)
            waiting = asyncio.create_task(controller.next_batch(timeout_s=1.5))  # counts from now
            for job in jobs:
                await trajectories.publish(trajectory(job, 0.0, version=3, error="env error: step -> 500"))
            with pytest.raises(TimeoutError):
                await waiting
        stalls = [r.message for r in caplog.records if r.message.startswith("no update batch")]
        assert stalls, caplog.text
        assert f"{len(jobs)} trajectories came back untrainable" in stalls[-1], stalls
        assert "the last because: the episode failed: env error: step -> 500" in stalls[-1], stalls
    finally:
        await controller.close()
