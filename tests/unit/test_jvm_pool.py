"""The ScienceWorld JVM pool and env in-process, on real JVMs: leasing, waiting, reuse, failures.

The pool hands out slots and starts a JVM only when a lease first runs a call, so the tests of
waiting and order use leases without JVMs; the rest start real ones (~2 s each).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from pydantic import ValidationError

from env_server.core import EnvFailure
from env_server.envs.embodied.jvm_pool import (
    JvmPool,
    JvmPoolSettings,
    ScienceWorldJvm,
    default_pool_size,
    shared_pool,
)
from env_server.envs.embodied.sciworld import (
    AGENTGYM_EXCLUDED,
    AGENTGYM_SIZE,
    MAX_AVAILABLE_ACTIONS,
    TASKS,
    SciWorldEnv,
    SciWorldOptions,
    choose,
)
from services.errors import ApiError

# The cheapest reset measured on a warm JVM (30-100 ms) with no valid-action list to work out.
CHEAP = SciWorldOptions(task="boil", action_hints=False)


def settings(**overrides: float) -> JvmPoolSettings:
    return JvmPoolSettings(**{"pool_size": 1, "acquire_timeout_s": 5.0, "call_timeout_s": 30.0, **overrides})


def state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z zombie), or '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it (the pool does that). A killed
    JVM's /proc state turns Z while its threads are still being torn down, before it has exited."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def wait_gone(pid: int) -> None:
    wait_until(lambda: exited(pid), f"JVM {pid} to exit", deadline_s=10, interval_s=0.02)


@pytest.fixture(scope="module")
def pool() -> Iterator[JvmPool]:
    """One JVM for the module: tests that kill it leave the next one to start a new (cold) one."""
    pool = JvmPool(settings())
    yield pool
    pids = pool.pids()
    pool.shutdown()
    for pid in pids:
        wait_gone(pid)


def the_pid(pool: JvmPool) -> int:
    (pid,) = pool.pids()
    return pid


def test_the_split_table_is_what_the_simulator_says(pool: JvmPool) -> None:
    def variations(java_list: object) -> list[int]:
        return json.loads(str(java_list))  # one call; list() would fetch element by element

    def check(jvm: ScienceWorldJvm) -> None:
        assert sorted(task.name for task in TASKS) == sorted(jvm.get_task_names())
        for task in TASKS:
            jvm.load(task.name, 0)
            assert jvm.get_max_variations(task.name) == task.variations, task
            assert variations(jvm.server.getVariationsTrain()) == list(task.split("train")), task
            assert variations(jvm.server.getVariationsDev()) == list(task.split("dev")), task
            assert variations(jvm.server.getVariationsTest()) == list(task.split("test")), task

    lease = pool.acquire()
    try:
        lease.run(check, fresh=True)
    finally:
        lease.release()


def test_agentgym_indices_walk_its_task_list() -> None:
    """AgentGym's server lists (task, variation) for every variation of each task it keeps, in the
    package's task order; data_idx indexes that list."""
    expected = [
        {"task": task.name, "split": "all", "variation": variation}
        for task in TASKS
        if task.id not in AGENTGYM_EXCLUDED
        for variation in range(task.variations)
    ]
    assert len(expected) == AGENTGYM_SIZE == 4639
    assert [SciWorldEnv.agentgym_task(i) for i in range(AGENTGYM_SIZE)] == list(enumerate(expected))
    for options in expected[::97]:
        SciWorldOptions.model_validate(options)
    with pytest.raises(ApiError) as caught:
        SciWorldEnv.agentgym_task(AGENTGYM_SIZE)
    assert caught.value.status == 422 and "4639" in caught.value.message


def test_options_name_tasks_every_way_and_refuse_contradictions() -> None:
    for spelling in ("boil", "1-1", 0, "0", "Matter Changes of State (Boiling)", "task-1-boil"):
        assert SciWorldOptions(task=spelling).task == "boil"
    refused = [
        ({"task": "bake a cake"}, "unknown task"),
        ({"task": 30}, "not in 0-29"),
        ({"variation": 3}, "needs a task"),
        ({"task": "boil", "variation": 20}, "not in boil's train split (0-13)"),
        ({"task": "boil", "split": "test", "variation": 3}, "test split (21-29)"),
        ({"task": "power-component", "simplifications": ["noElectricalAction"]}, "electricity"),
        ({"simplifications": ["noElectricalAction"]}, "electricity"),
        ({"simplifications": ["fly"]}, "simplifications"),
        ({"level": 1}, "Extra inputs"),
    ]
    for options, message in refused:
        with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            SciWorldOptions.model_validate(options)
    assert SciWorldOptions(task="boil", split="all", variation=29).variation == 29


def test_the_seed_picks_the_task_then_a_variation_of_the_split() -> None:
    assert choose(0, SciWorldOptions()) == (TASKS[0], 0)
    assert choose(31, SciWorldOptions()) == (TASKS[1], 1)
    assert choose(30 * 14, SciWorldOptions()) == (TASKS[0], 0)  # boil has 14 train variations
    assert choose(15, SciWorldOptions(task="boil", split="dev")) == (TASKS[0], 14 + 15 % 7)
    assert choose(15, SciWorldOptions(task="boil", split="test", variation=22)) == (TASKS[0], 22)


def test_a_closed_instance_returns_its_jvm_for_the_next_task(pool: JvmPool) -> None:
    first = SciWorldEnv(pool)
    observed = first.reset(3, CHEAP)
    assert observed.observation.startswith("Your task is to boil")
    assert "is called the" in observed.observation.splitlines()[1]  # the first look around
    assert observed.info == {"task": "boil", "task_id": "1-1", "variation": 3, "split": "train"}
    pid = the_pid(pool)
    first.close()
    first.close()  # idempotent: the slot is given back once
    assert pool.idle_jvms == 1

    second = SciWorldEnv(pool)
    observed = second.reset(0, SciWorldOptions(task="find-plant", split="test", action_hints=False))
    assert observed.info["task"] == "find-plant" and observed.info["variation"] == 225
    assert the_pid(pool) == pid
    second.close()


def test_steps_score_and_list_the_valid_actions(pool: JvmPool) -> None:
    env = SciWorldEnv(pool)
    env.reset(4, SciWorldOptions(task="find-non-living-thing", gold_path=True))
    available = env.available_actions()
    assert available is not None and "look around" in available
    assert len(available) <= MAX_AVAILABLE_ACTIONS
    assert env.step("look around.").info == {"valid": True, "score": 0, "success": False}
    refused = env.step("fly to the moon")
    assert (refused.observation, refused.reward, refused.info["valid"]) == (
        "No known action matches that input.",
        0.0,
        False,
    )
    observed = env.reset(4, SciWorldOptions(task="find-non-living-thing", gold_path=True))
    rewards = [env.step(action) for action in observed.info["gold_actions"]]
    assert [step.done for step in rewards] == [False] * (len(rewards) - 1) + [True]
    assert sum(step.reward for step in rewards) == pytest.approx(1.0)
    assert rewards[-1].info == {"valid": True, "score": 100, "success": True}
    assert env.available_actions() == []
    env.close()


def test_focusing_on_the_wrong_thing_fails_the_episode(pool: JvmPool) -> None:
    env = SciWorldEnv(pool)
    env.reset(0, SciWorldOptions(task="find-living-thing", action_hints=False))
    step = env.step("focus on door to kitchen")
    assert (step.done, step.reward, step.info["score"], step.info["success"]) == (True, -1.0, -100, False)
    env.close()


def test_a_full_pool_waits_then_answers_429() -> None:
    pool = JvmPool(settings(acquire_timeout_s=0.3))
    held = pool.acquire()
    started = time.monotonic()
    with pytest.raises(ApiError) as caught:
        pool.acquire()
    assert 0.3 <= time.monotonic() - started < 2.0
    assert (caught.value.status, caught.value.code) == (429, "jvm_pool_busy")
    assert "all 1 ScienceWorld JVMs are in use" in caught.value.message
    held.release()
    pool.acquire(timeout_s=0).release()  # the slot is free again at once


async def test_waiters_are_served_in_order_on_the_event_loop() -> None:
    pool = JvmPool(settings(acquire_timeout_s=5.0))
    held = pool.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        lease = await pool.acquire_async()
        order.append(name)
        await asyncio.sleep(0.05)
        lease.release()

    waiters = [asyncio.create_task(wait(name)) for name in "abc"]
    await asyncio.sleep(0.1)
    # Waiting holds no thread: the loop runs other work meanwhile, and releasing from a thread
    # (as env.close does on the host's workers) wakes the first waiter.
    assert order == []
    threading.Thread(target=held.release).start()
    await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
    assert order == ["a", "b", "c"]


async def test_an_async_wait_past_its_deadline_is_a_429_and_leaves_no_waiter() -> None:
    pool = JvmPool(settings(acquire_timeout_s=0.2))
    held = pool.acquire()
    with pytest.raises(ApiError, match=r"none came free within 0\.2 s"):
        await pool.acquire_async()
    cancelled = asyncio.create_task(pool.acquire_async(timeout_s=5.0))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    held.release()
    pool.acquire(timeout_s=0).release()


def test_a_killed_jvm_ends_its_instance_and_frees_its_slot(pool: JvmPool) -> None:
    env = SciWorldEnv(pool)
    env.reset(0, CHEAP)
    pid = the_pid(pool)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EnvFailure, match=rf"the ScienceWorld JVM \(pid {pid}\) exited with code -9"):
        env.step("look around")
    env.close()
    assert pool.live_jvms == 0
    replacement = SciWorldEnv(pool)
    replacement.reset(0, CHEAP)
    assert the_pid(pool) != pid
    replacement.close()


def test_a_hung_call_is_killed_at_its_deadline() -> None:
    pool = JvmPool(settings())
    lease = pool.acquire()
    try:
        pid = lease.run(lambda jvm: jvm.pid, fresh=True)  # starts a JVM, loads no task
        pool.settings.call_timeout_s = 1.0  # not before: the start is under the same deadline
        os.kill(pid, signal.SIGSTOP)  # the JVM stops answering; only SIGKILL ends it now
        wait_until(lambda: state(pid) == "T", "the JVM to stop", deadline_s=10, interval_s=0.02)
        started = time.monotonic()
        with pytest.raises(EnvFailure, match=rf"\(pid {pid}\) did not answer within 1 s; killed"):
            lease.run(lambda jvm: jvm.server.getNumMoves())
        assert 1.0 <= time.monotonic() - started < 3.0
        wait_gone(pid)
    finally:
        lease.release()
    assert pool.live_jvms == 0


def test_a_jvm_that_died_between_episodes_is_replaced_at_reset(pool: JvmPool) -> None:
    env = SciWorldEnv(pool)
    env.reset(0, CHEAP)
    pid = the_pid(pool)
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    env.reset(1, CHEAP)  # a new episode loses nothing: no failure, a new JVM
    assert the_pid(pool) != pid
    env.close()
    idle = the_pid(pool)
    os.kill(idle, signal.SIGKILL)
    wait_gone(idle)
    other = SciWorldEnv(pool)
    other.reset(2, CHEAP)  # the dead idle JVM was dropped, not lent out
    assert the_pid(pool) not in (pid, idle)
    other.close()


def test_shutdown_ends_idle_and_leased_jvms() -> None:
    pool = JvmPool(settings(pool_size=2))
    idle, leased = pool.acquire(), pool.acquire()
    pids = {lease.run(lambda jvm: jvm.pid, fresh=True) for lease in (idle, leased)}
    idle.release()
    assert pool.pids() == pids and pool.idle_jvms == 1
    pool.shutdown()
    for pid in pids:
        wait_gone(pid)
    leased.release()  # after shutdown: nothing to keep
    assert pool.live_jvms == 0


def test_the_shared_pool_ends_at_shutdown_and_starts_again_on_use() -> None:
    env = SciWorldEnv()  # the process's shared pool, as the host and `stargym model init` use it
    env.reset(0, CHEAP)
    (pid,) = shared_pool().pids()
    env.close()
    SciWorldEnv.shutdown()
    wait_gone(pid)
    again = SciWorldEnv()
    again.reset(0, CHEAP)
    assert shared_pool().pids() != {pid}
    again.close()


def test_the_default_pool_size_respects_a_containers_memory_limit(tmp_path: Path) -> None:
    """A container sees the host's memory: the cgroup's limit (v2 or v1) bounds the pool instead."""
    unlimited = default_pool_size(tmp_path)  # no cgroup files: cores and physical memory
    assert unlimited >= 1
    (tmp_path / "memory.max").write_text("max\n")
    assert default_pool_size(tmp_path) == unlimited
    (tmp_path / "memory.max").write_text(f"{3 * 2**30}\n")  # cgroup v2, 3 GiB: at most 3 JVMs
    assert default_pool_size(tmp_path) == min(unlimited, 3)
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2**29}\n")  # cgroup v1, 512 MiB
    assert default_pool_size(tmp_path) == 1
