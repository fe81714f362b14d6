"""The instance pool in-process, without HTTP: limit, TTL reaping, locks, multi-action turns, options."""

from __future__ import annotations

import asyncio
import threading

import pytest
from pydantic import BaseModel, ConfigDict, Field

from env_server.core import Env, Observation, Step
from env_server.pool import HostOptions, InstancePool, parse_options, play_turn
from services.errors import ApiError


class CountOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: int = Field(default=3, ge=1)
    start: int = 0


class CountEnv(Env):
    """Say 'up' until the counter reaches the target; anything else is invalid. Records its calls."""

    name = "count"
    family = "test"
    instruction = "Say 'up'."
    action_format = "up"
    default_max_turns = 10
    reward_range = (0.0, 1.0)
    Options = CountOptions
    runs_inline = True

    def __init__(self) -> None:
        self.value = 0
        self.target = 3
        self.actions: list[str] = []
        self.closed = 0

    def reset(self, seed: int, options: CountOptions) -> Observation:
        self.value, self.target = options.start, options.target
        return Observation(f"seed {seed} at {self.value}", {"seed": seed})

    def step(self, action: str) -> Step:
        self.actions.append(action)
        if action != "up":
            return Step(f"at {self.value}", 0.0, False, {"valid": False})
        self.value += 1
        done = self.value >= self.target
        return Step(f"at {self.value}", 1.0 if done else 0.1, done, {"valid": True})

    def available_actions(self) -> list[str]:
        return ["up"]

    def close(self) -> None:
        self.closed += 1


class BlockingEnv(CountEnv):
    """CountEnv on worker threads, whose reset waits for an event when its seed is 99."""

    name = "blocking"
    runs_inline = False
    release = threading.Event()
    threads: set[int] = set()

    def reset(self, seed: int, options: CountOptions) -> Observation:
        BlockingEnv.threads.add(threading.get_ident())
        if seed == 99:
            assert BlockingEnv.release.wait(timeout=30)
        return super().reset(seed, options)


class FailingEnv(CountEnv):
    name = "failing"

    def reset(self, seed: int, options: CountOptions) -> Observation:
        raise RuntimeError("reset failed")


def make_pool(max_instances: int = 10, ttl_s: float = 60.0) -> InstancePool:
    classes = {cls.env_id(): cls for cls in (CountEnv, BlockingEnv, FailingEnv)}
    return InstancePool(classes, max_instances=max_instances, ttl_s=ttl_s)


def code_of(raised: pytest.ExceptionInfo[ApiError]) -> tuple[int, str]:
    return raised.value.status, raised.value.code


# ---------------------------------------------------------------- create, limit, lookups


async def test_create_step_reset_close() -> None:
    pool = make_pool()
    instance, first = await pool.create("test/count", 5, {"target": 2})
    assert first.observation == "seed 5 at 0" and first.info == {"seed": 5}
    assert len(pool) == 1 and pool.get(instance.instance_id) is instance
    assert (instance.seed, instance.options, instance.observation) == (5, {"target": 2}, "seed 5 at 0")

    assert (await pool.step(instance.instance_id, "up")).done is False
    last = await pool.step(instance.instance_id, "up")
    assert last.done is True and last.reward == 1.0
    assert (instance.turns, instance.done, instance.observation) == (2, True, "at 2")
    assert instance.total_reward == pytest.approx(1.1)
    with pytest.raises(ApiError) as raised:
        await pool.step(instance.instance_id, "up")
    assert code_of(raised) == (409, "episode_done")

    again = await pool.reset(instance.instance_id, None, None)  # same seed, options kept
    assert again.observation == "seed 5 at 0"
    assert (instance.turns, instance.done, instance.total_reward, instance.options) == (
        0,
        False,
        0.0,
        {"target": 2},
    )
    assert (await pool.step(instance.instance_id, "up")).done is False

    env = instance.env
    await pool.close(instance.instance_id)
    assert len(pool) == 0 and env.closed == 1
    for call in (
        pool.step(instance.instance_id, "up"),
        pool.reset(instance.instance_id, None, None),
        pool.close(instance.instance_id),
    ):
        with pytest.raises(ApiError) as raised:
            await call
        assert code_of(raised) == (404, "not_found")


async def test_reset_with_new_seed_and_options() -> None:
    pool = make_pool()
    instance, _ = await pool.create("test/count", 1, {"target": 5, "start": 1})
    observed = await pool.reset(instance.instance_id, 8, None)
    assert observed.observation == "seed 8 at 1" and instance.seed == 8
    observed = await pool.reset(instance.instance_id, None, {"start": 4})
    assert observed.observation == "seed 8 at 4" and instance.options == {"start": 4}
    assert instance.env.target == 3  # options replaced as a whole, not merged
    with pytest.raises(ApiError) as raised:
        await pool.reset(instance.instance_id, 9, {"start": "x"})
    assert code_of(raised) == (422, "invalid_options")
    assert (instance.seed, instance.options) == (8, {"start": 4})  # untouched by the failed reset


async def test_unknown_env_and_random_seed() -> None:
    pool = make_pool()
    with pytest.raises(ApiError) as raised:
        await pool.create("test/nope", 0, None)
    assert code_of(raised) == (404, "not_found")
    seeds = {(await pool.create("test/count", None, None))[0].seed for _ in range(5)}
    assert len(seeds) > 1 and all(seed >= 0 for seed in seeds)


async def test_instance_limit() -> None:
    pool = make_pool(max_instances=2)
    first, _ = await pool.create("test/count", 0, None)
    await pool.create("test/count", 1, None)
    with pytest.raises(ApiError) as raised:
        await pool.create("test/count", 2, None)
    assert code_of(raised) == (429, "instance_limit")
    await pool.close(first.instance_id)
    await pool.create("test/count", 3, None)
    assert len(pool) == 2


async def test_instance_limit_counts_creates_in_flight() -> None:
    """Creates still resetting count against the limit: five at once with room for two."""
    BlockingEnv.release.clear()
    pool = make_pool(max_instances=2)
    tasks = [asyncio.create_task(pool.create("test/blocking", 99, None)) for _ in range(5)]
    try:
        async with asyncio.timeout(10):
            while sum(task.done() for task in tasks) < 3:
                await asyncio.sleep(0.01)
        refused = [task for task in tasks if task.done()]
        assert len(refused) == 3  # the two admitted ones cannot finish before the release
        for task in refused:
            assert isinstance(task.exception(), ApiError) and task.exception().status == 429
        assert len(pool) == 0  # the other two are still resetting
    finally:
        BlockingEnv.release.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert sum(not isinstance(result, Exception) for result in results) == 2
    assert len(pool) == 2 and pool._reserved == 0


async def test_failed_create_releases_its_slot() -> None:
    pool = make_pool(max_instances=1)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="reset failed"):
            await pool.create("test/failing", 0, None)
    assert pool._reserved == 0 and len(pool) == 0
    await pool.create("test/count", 0, None)


async def test_threaded_env_runs_off_the_event_loop() -> None:
    pool = make_pool()
    BlockingEnv.threads.clear()
    await pool.create("test/blocking", 1, None)
    assert BlockingEnv.threads and threading.get_ident() not in BlockingEnv.threads


# ---------------------------------------------------------------- locks and batches


async def test_steps_wait_for_a_blocked_reset_of_their_instance_only() -> None:
    BlockingEnv.release.clear()
    pool = make_pool()
    slow, _ = await pool.create("test/blocking", 1, None)
    other, _ = await pool.create("test/blocking", 2, None)
    try:
        reset = asyncio.create_task(pool.reset(slow.instance_id, 99, None))
        step_slow = asyncio.create_task(pool.step(slow.instance_id, "up"))
        for _ in range(3):  # the other instance plays its episode while the slow one is blocked
            await asyncio.wait_for(pool.step(other.instance_id, "up"), timeout=10)
        assert other.done and not reset.done() and not step_slow.done()
        assert slow.lock.locked()
    finally:
        BlockingEnv.release.set()
    await asyncio.wait_for(reset, timeout=30)
    result = await asyncio.wait_for(step_slow, timeout=30)
    assert result.observation == "at 1" and slow.seed == 99  # the step ran after the reset


async def test_step_many_keeps_per_instance_order() -> None:
    pool = make_pool()
    a, _ = await pool.create("test/count", 0, {"target": 2})
    b, _ = await pool.create("test/count", 0, {"target": 5})
    outcomes = await pool.step_many(
        [
            (a.instance_id, "up"),
            ("missing", "up"),
            (b.instance_id, "nope"),
            (a.instance_id, "up"),
            (a.instance_id, "up"),
        ]
    )
    assert [o.observation if isinstance(o, Step) else o.code for o in outcomes] == [
        "at 1",
        "not_found",
        "at 0",
        "at 2",
        "episode_done",
    ]
    assert a.env.actions == ["up", "up"] and b.env.actions == ["nope"]
    assert await pool.step_many([]) == []


# ---------------------------------------------------------------- reaping


async def test_reap_idle_closes_only_idle_unlocked_instances() -> None:
    """One idle, one idle by its clock but busy (its lock held), one fresh: only the first goes."""
    pool = make_pool(ttl_s=100.0)
    old, _ = await pool.create("test/count", 0, None)
    busy, _ = await pool.create("test/count", 1, None)
    fresh, _ = await pool.create("test/count", 2, None)
    old.last_used_at -= 101
    busy.last_used_at -= 101
    async with busy.lock:
        assert await pool.reap_idle() == 1
    assert set(pool.instances) == {busy.instance_id, fresh.instance_id}
    assert old.env.closed == 1 and pool.reaped_total == 1
    assert await pool.reap_idle() == 1  # once its lock is free, the idle busy one goes too
    assert set(pool.instances) == {fresh.instance_id} and pool.reaped_total == 2


async def test_use_keeps_an_instance_alive() -> None:
    pool = make_pool(ttl_s=100.0)
    instance, _ = await pool.create("test/count", 0, None)
    instance.last_used_at -= 101
    await pool.step(instance.instance_id, "up")
    assert await pool.reap_idle() == 0
    instance.last_used_at -= 101
    await pool.reset(instance.instance_id, None, None)
    assert await pool.reap_idle() == 0 and len(pool) == 1


async def test_reap_forever_with_a_tiny_ttl() -> None:
    pool = make_pool(ttl_s=0.01)
    for seed in range(3):
        await pool.create("test/count", seed, None)
    reaper = asyncio.create_task(pool.reap_forever(0.01))
    try:
        async with asyncio.timeout(10):
            while len(pool):
                await asyncio.sleep(0.01)
    finally:
        reaper.cancel()
    assert pool.reaped_total == 3


async def test_close_all() -> None:
    pool = make_pool()
    instances = [(await pool.create("test/count", seed, None))[0] for seed in range(3)]
    await pool.close_all()
    assert len(pool) == 0 and all(instance.env.closed == 1 for instance in instances)


# ---------------------------------------------------------------- options and multi-action turns


def test_parse_options_splits_host_and_env_options() -> None:
    env_options, host_options = parse_options(CountEnv, {"target": 7, "max_actions_per_turn": 3})
    assert env_options == CountOptions(target=7) and host_options.max_actions_per_turn == 3
    env_options, host_options = parse_options(CountEnv, {})
    assert env_options == CountOptions() and host_options == HostOptions()


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"colour": "red"}, "colour"),
        ({"target": 0}, "target"),
        ({"target": "many"}, "target"),
        ({"max_actions_per_turn": 0}, "max_actions_per_turn"),
        ({"max_actions_per_turn": 65}, "max_actions_per_turn"),
        ({"max_actions_per_turn": "2x"}, "max_actions_per_turn"),
    ],
)
def test_parse_options_errors(options: dict, where: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_options(CountEnv, options)
    assert code_of(raised) == (422, "invalid_options")
    assert raised.value.message.startswith("test/count: ") and where in raised.value.message


async def test_create_rejects_invalid_options_before_using_a_slot() -> None:
    pool = make_pool(max_instances=1)
    with pytest.raises(ApiError) as raised:
        await pool.create("test/count", 0, {"colour": "red"})
    assert code_of(raised) == (422, "invalid_options")
    assert len(pool) == 0 and pool._reserved == 0


def make_env(target: int = 3) -> CountEnv:
    env = CountEnv()
    env.reset(0, CountOptions(target=target))
    return env


def test_play_turn_single_action_is_not_split() -> None:
    env = make_env()
    step = play_turn(env, "up || up", HostOptions())
    assert env.actions == ["up || up"] and step.info == {"valid": False}


@pytest.mark.parametrize(
    ("reply", "limit", "actions", "done", "valid", "reward"),
    [
        ("up || up", 2, ["up", "up"], False, True, 0.2),
        ("up||up||up", 3, ["up", "up", "up"], True, True, 1.2),
        ("up || up || up", 2, ["up", "up"], False, True, 0.2),  # at most the limit
        ("up || up || up || up", 5, ["up", "up", "up"], True, True, 1.2),  # stops when done
        ("jump || up", 2, ["jump", "up"], False, False, 0.1),  # one invalid makes the turn invalid
        (" up ||  || up ", 2, ["up", "up"], False, True, 0.2),  # blanks dropped, parts stripped
        ("", 2, [""], False, False, 0.0),
        (" || ", 2, [""], False, False, 0.0),
    ],
)
def test_play_turn_splits_multi_action_replies(reply, limit, actions, done, valid, reward) -> None:
    env = make_env()
    step = play_turn(env, reply, HostOptions(max_actions_per_turn=limit))
    assert env.actions == actions
    assert (step.done, step.info["valid"], step.info["actions_executed"]) == (done, valid, len(actions))
    assert step.info["invalid_actions"] == sum(action != "up" for action in actions)
    assert step.reward == pytest.approx(reward)
    assert step.observation == f"at {env.value}"
