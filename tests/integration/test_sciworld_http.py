"""ScienceWorld over HTTP on real servers and JVMs: gold paths, the JVM pool under load, failures.

Every server also hosts the bandit, an env stepped on the event loop itself, to show that JVM
calls (run on worker threads) and waits for a JVM (awaited on the loop) never stall it. Java
processes are counted as the server's children in /proc.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import RunningServer, free_port, start_server, stop_server, wait_until

ENV = "embodied/sciworld"
SERVE = [
    "env",
    "serve",
    "--env",
    "env_server.envs.embodied.sciworld:SciWorldEnv",
    "--env",
    "env_server.envs.game.bandit:BanditEnv",
]
# The cheapest reset measured on a warm JVM (30-100 ms): no valid-action list to work out.
CHEAP = {"task": "boil", "action_hints": False}
SHORT_EPISODE = {"task": "find-non-living-thing", "gold_path": True, "action_hints": False}  # 5 steps
TIMEOUT = httpx.Timeout(180.0)


def stop(server: RunningServer) -> None:
    """Stop the server and wait for its JVMs, which exit when their stdin closes with it."""
    jvms = java_children(server)
    stop_server(server.process)
    wait_until(lambda: all(state(pid) in ("", "Z") for pid in jvms), "the JVMs to exit", deadline_s=15)


def serve(tmp_path: Path, name: str, **pool: float) -> RunningServer:
    """A server of sciworld and bandit whose JVM pool has the given settings."""
    port = free_port()
    env = {f"STARGYM_SCIWORLD_{key.upper()}": str(value) for key, value in pool.items()}
    return start_server([*SERVE, "--port", str(port)], port, tmp_path, env=env, name=name)


def state(pid: int) -> str:
    """The process's state letter (S, R, T stopped, Z zombie), or '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def java_children(server: RunningServer) -> set[int]:
    """The live (not zombie) java processes whose parent is the server."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, tail = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = tail.split()
        if head.endswith("(java") and int(fields[1]) == server.process.pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def the_jvm(server: RunningServer) -> int:
    (pid,) = java_children(server)
    return pid


def create(client: httpx.Client, options: dict, seed: int = 0) -> dict:
    response = client.post("/instances", json={"env": ENV, "seed": seed, "options": options})
    assert response.status_code == 201, response.text
    return response.json()


def play(client: httpx.Client, instance_id: str, actions: list[str]) -> list[dict]:
    """Step through ``actions`` until the episode ends (a gold path may go on past full score)."""
    steps = []
    for action in actions:
        response = client.post(f"/instances/{instance_id}/step", json={"action": action})
        assert response.status_code == 200, response.text
        steps.append(response.json())
        if steps[-1]["done"]:
            break
    return steps


class BanditProbe:
    """Steps a bandit instance in a loop on its own thread, timing each reset and step."""

    def __init__(self, server: RunningServer) -> None:
        self._client = httpx.Client(base_url=server.url, timeout=TIMEOUT)
        created = self._client.post("/instances", json={"env": "game/bandit", "seed": 0})
        self.instance_id = created.json()["instance_id"]
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BanditProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._client.delete(f"/instances/{self.instance_id}")
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self._client.post(f"/instances/{self.instance_id}/reset", json={})
            step = self._client.post(f"/instances/{self.instance_id}/step", json={"action": "Dragon"})
            assert step.status_code == 200, step.text
            self.latencies.append(time.perf_counter() - started)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A pool of 4 JVMs whose creates wait long enough for 32 episodes to take turns."""
    server = serve(
        tmp_path_factory.mktemp("sciworld-big"), "sciworld-big", pool_size=4, acquire_timeout_s=120
    )
    yield server
    stop(server)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One JVM, a 2 s wait for it and a 5 s deadline per JVM call."""
    server = serve(
        tmp_path_factory.mktemp("sciworld-small"),
        "sciworld-small",
        pool_size=1,
        acquire_timeout_s=2,
        call_timeout_s=5,
    )
    yield server
    stop(server)


@pytest.fixture
def big_client(big: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=big.url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
def small_client(small: RunningServer) -> Iterator[httpx.Client]:
    """A client of the one-JVM server that closes every instance a test leaves open: a failed
    test must not leave the only JVM leased, which turns the next tests' creates into 429s."""
    with httpx.Client(base_url=small.url, timeout=TIMEOUT) as client:
        yield client
        for left in client.get("/instances").json()["instances"]:
            client.delete(f"/instances/{left['instance_id']}")


@pytest.mark.parametrize("task", ["find-non-living-thing", "lifespan-longest-lived", "power-component"])
def test_the_gold_path_reaches_full_score(big_client: httpx.Client, task: str) -> None:
    created = create(big_client, {"task": task, "gold_path": True}, seed=7)
    instance_id, gold = created["instance_id"], created["info"]["gold_actions"]
    assert created["info"]["task"] == task and created["info"]["split"] == "train"
    available = big_client.get(f"/instances/{instance_id}/available_actions").json()
    assert "look around" in available and len(available) <= 200
    steps = play(big_client, instance_id, gold)
    assert [step["done"] for step in steps] == [False] * (len(steps) - 1) + [True]
    assert sum(step["reward"] for step in steps) == pytest.approx(1.0)
    assert steps[-1]["info"] == {"valid": True, "score": 100, "success": True}
    assert big_client.get(f"/instances/{instance_id}").json()["total_reward"] == pytest.approx(1.0)
    assert big_client.get(f"/instances/{instance_id}/available_actions").json() == []
    after = big_client.post(f"/instances/{instance_id}/step", json={"action": "look around"})
    assert (after.status_code, after.json()["error"]["code"]) == (409, "episode_done")
    assert big_client.delete(f"/instances/{instance_id}").status_code == 204


def test_bad_options_and_actions_get_the_game_family_contract(big_client: httpx.Client) -> None:
    for options, message in [
        ({"task": "bake a cake"}, "unknown task 'bake a cake'"),
        ({"task": "boil", "variation": 25}, "not in boil's train split"),
        ({"level": 3}, "level"),
    ]:
        response = big_client.post("/instances", json={"env": ENV, "options": options})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "invalid_options" and message in response.text
    instance_id = create(big_client, CHEAP)["instance_id"]
    (refused,) = play(big_client, instance_id, ["!!! jump over the house"])
    assert (refused["observation"], refused["info"]["valid"], refused["done"]) == (
        "No known action matches that input.",
        False,
        False,
    )
    big_client.delete(f"/instances/{instance_id}")


def test_agentgym_routes_play_the_task_of_a_data_idx(big_client: httpx.Client) -> None:
    created = big_client.post("/agentgym/sciworld/create")
    assert created.status_code == 200, created.text
    instance_id = created.json()["id"]
    reset = big_client.post("/agentgym/sciworld/reset", json={"id": instance_id, "data_idx": 31})
    assert reset.json()["observation"].startswith("Your task is to melt")  # melt's variation 1
    step = big_client.post("/agentgym/sciworld/step", json={"id": instance_id, "action": "look around"})
    assert step.status_code == 200 and step.json()["done"] is False
    past = big_client.post("/agentgym/sciworld/reset", json={"id": instance_id, "data_idx": 4639})
    assert past.status_code == 422
    assert big_client.post("/agentgym/sciworld/close", json={"id": instance_id}).json() is True


def test_32_concurrent_episodes_share_a_pool_of_4(big: RunningServer) -> None:
    samples: list[set[int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(java_children(big))
            time.sleep(0.05)

    def episode(seed: int) -> float:
        with httpx.Client(base_url=big.url, timeout=TIMEOUT) as client:
            created = create(client, SHORT_EPISODE, seed=seed)
            steps = play(client, created["instance_id"], created["info"]["gold_actions"])
            client.delete(f"/instances/{created['instance_id']}")
        assert steps[-1]["done"]
        return sum(step["reward"] for step in steps)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(32) as clients:
            totals = list(clients.map(episode, range(32)))
    finally:
        done.set()
        sampler.join(5)
    assert totals == pytest.approx([1.0] * 32)
    assert samples and 1 <= len(set().union(*samples)) <= 4  # never more JVMs, none replaced


def test_200_create_close_cycles_reuse_the_same_jvms(big: RunningServer, big_client: httpx.Client) -> None:
    # Four instances at once make the pool start all four JVMs, if earlier tests did not.
    with ThreadPoolExecutor(4) as clients:
        held = list(clients.map(lambda seed: create(big_client, CHEAP, seed)["instance_id"], range(4)))
    for instance_id in held:
        big_client.delete(f"/instances/{instance_id}")
    jvms = java_children(big)
    assert len(jvms) == 4

    def cycles(worker: int) -> set[int]:
        seen = set()
        with httpx.Client(base_url=big.url, timeout=TIMEOUT) as client:
            for cycle in range(50):
                instance_id = create(client, CHEAP, seed=worker * 50 + cycle)["instance_id"]
                assert client.delete(f"/instances/{instance_id}").status_code == 204
                seen |= java_children(big)
        return seen

    with ThreadPoolExecutor(4) as clients:
        seen = set().union(*clients.map(cycles, range(4)))
    assert seen == jvms == java_children(big)  # no JVM started, replaced or leaked in 200 cycles


def test_a_full_pool_answers_429_after_its_deadline(small: RunningServer, small_client: httpx.Client) -> None:
    holder = create(small_client, CHEAP)["instance_id"]
    jvm = the_jvm(small)
    with BanditProbe(small) as probe:
        started = time.monotonic()
        refused = small_client.post("/instances", json={"env": ENV, "options": CHEAP})
        waited = time.monotonic() - started
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "jvm_pool_busy"
    assert 2.0 <= waited < 4.0
    # The wait is awaited on the event loop: the bandit kept stepping all along. A loop blocked by
    # the wait would show one reset+step of at least its 2 s; a loaded CI machine showed 0.84 s.
    assert len(probe.latencies) >= 20 and max(probe.latencies) < 1.5, probe.latencies
    small_client.delete(f"/instances/{holder}")
    started = time.monotonic()
    reused = create(small_client, CHEAP)["instance_id"]
    assert time.monotonic() - started < 2.0 and the_jvm(small) == jvm
    small_client.delete(f"/instances/{reused}")


def test_a_killed_jvm_ends_only_its_instance(small: RunningServer, small_client: httpx.Client) -> None:
    bystander = small_client.post("/instances", json={"env": "game/bandit", "seed": 1}).json()["instance_id"]
    instance_id = create(small_client, CHEAP)["instance_id"]
    jvm = the_jvm(small)
    os.kill(jvm, signal.SIGKILL)
    failed = small_client.post(f"/instances/{instance_id}/step", json={"action": "look around"})
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"] == {
        "code": "env_failed",
        "message": f"{ENV}: instance {instance_id} failed and is closed: "
        f"the ScienceWorld JVM (pid {jvm}) exited with code -9",
    }
    assert small_client.get(f"/instances/{instance_id}").status_code == 404
    assert small_client.get(f"/instances/{bystander}").status_code == 200
    replacement = create(small_client, CHEAP)["instance_id"]
    assert java_children(small) == {the_jvm(small)} and the_jvm(small) != jvm
    small_client.delete(f"/instances/{replacement}")
    small_client.delete(f"/instances/{bystander}")


def test_a_hung_jvm_is_killed_while_other_envs_keep_stepping(
    small: RunningServer, small_client: httpx.Client
) -> None:
    instance_id = create(small_client, CHEAP)["instance_id"]
    jvm = the_jvm(small)
    os.kill(jvm, signal.SIGSTOP)  # the JVM stops answering: the next call blocks its worker thread
    wait_until(lambda: state(jvm) == "T", "the JVM to stop", deadline_s=5)
    with BanditProbe(small) as probe:
        started = time.monotonic()
        failed = small_client.post(f"/instances/{instance_id}/step", json={"action": "look around"})
        blocked = time.monotonic() - started
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"]["message"].endswith(
        f"the ScienceWorld JVM (pid {jvm}) did not answer within 5 s; killed"
    )
    assert 5.0 <= blocked < 8.0
    # A loop blocked by the hung call would show one reset+step of at least its 5 s.
    assert len(probe.latencies) >= 50 and max(probe.latencies) < 2.5, probe.latencies
    wait_until(lambda: state(jvm) in ("", "Z"), "the hung JVM to die", deadline_s=5)
    replacement = create(small_client, CHEAP)["instance_id"]
    small_client.delete(f"/instances/{replacement}")


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_jvm_outlives_its_server(tmp_path: Path, sent: signal.Signals) -> None:
    """SIGTERM: the host closes its instances and then calls ``SciWorldEnv.shutdown``, which ends
    the idle JVM too, before the server exits (uvicorn re-raises the signal, so no atexit hook
    would run). SIGKILL: nothing runs, and each JVM exits when its stdin, a pipe from the server,
    closes with the server (measured: 0.3 s after it)."""
    server = serve(tmp_path, "sciworld-exit", pool_size=2)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            create(client, CHEAP)  # held: the JVM is leased
            closed = create(client, CHEAP, seed=1)["instance_id"]
            client.delete(f"/instances/{closed}")  # and another idle
        jvms = java_children(server)
        assert len(jvms) == 2
        server.process.send_signal(sent)
        server.process.wait(30)
    finally:
        stop_server(server.process)
    if sent == signal.SIGTERM:  # ended and reaped by the server itself
        assert [pid for pid in jvms if state(pid)] == []
    # Orphaned, they are reparented; a zombie is an exited process its new parent has not reaped.
    wait_until(lambda: all(state(pid) in ("", "Z") for pid in jvms), "the JVMs to exit", deadline_s=15)
