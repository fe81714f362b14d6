"""Untrusted envs run one process per instance, and a call that overruns is stopped.

A real server hosts the game family (trusted, in its process) beside ``test/hanging`` (a user's
env, sandboxed) with ``step_timeout_s`` of 2 s: a step that spins in Python or blocks in C ends
with 502 naming the timeout, its process is gone, and the other instances step on meanwhile; a
crash or an exception in env code ends only that instance; no process outlives the server.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RunningServer, free_port, start_server, stop_server, wait_until

HANGING = "test/hanging"
GUESS = "custom/guess"
STEP_TIMEOUT_S = 2.0
USER_ENVS = [
    "--env",
    "tests/integration/custom_env.py:HangingEnv",
    "--env",
    "tests/integration/custom_env.py:MyEnv",
]
TIMEOUT = httpx.Timeout(30.0)


def serve(
    tmp_path_factory: pytest.TempPathFactory, args: list[str], name: str, **settings: object
) -> RunningServer:
    port = free_port()
    env = {f"STARGYM_{key.upper()}": str(value) for key, value in settings.items()}
    return start_server(
        ["env", "serve", *args, "--port", str(port)], port, tmp_path_factory.mktemp(name), env, name
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = serve(tmp_path_factory, ["game", *USER_ENVS], "sandbox", step_timeout_s=STEP_TIMEOUT_S)
    yield running
    stop_server(running.process)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return False
    return state != "Z"


def new_hanging(http: httpx.Client, **options: object) -> tuple[str, int]:
    response = http.post("/instances", json={"env": HANGING, "seed": 1, "options": options})
    assert response.status_code == 201, response.text
    body = response.json()
    return body["instance_id"], body["info"]["pid"]


def assert_env_failed(response: httpx.Response, *fragments: str) -> str:
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "env_failed"
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error["message"]


def test_each_untrusted_instance_has_a_process_of_its_own(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        (first, first_pid), (second, second_pid) = new_hanging(http), new_hanging(http)
        assert first_pid != second_pid and first_pid != server.process.pid
        step = http.post(f"/instances/{first}/step", json={"action": "hello"}).json()
        assert step["observation"] == "hello" and step["info"]["pid"] == first_pid
        for instance_id in (first, second):
            assert http.delete(f"/instances/{instance_id}").status_code == 204
        wait_until(
            lambda: not alive(first_pid) and not alive(second_pid), "closed instances' processes to exit", 10
        )


@pytest.mark.parametrize("action", ["spin", "block"])
async def test_a_hung_step_is_stopped_while_other_instances_step_on(
    server: RunningServer, action: str
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
        hung = (await http.post("/instances", json={"env": HANGING, "seed": 1})).json()
        trusted = (await http.post("/instances", json={"env": "game/bandit", "seed": 1})).json()[
            "instance_id"
        ]
        sandboxed = (await http.post("/instances", json={"env": GUESS, "seed": 1})).json()["instance_id"]

        async def latencies(instance_id: str, action: str, count: int) -> list[float]:
            times = []
            for _ in range(count):
                began = time.perf_counter()
                response = await http.post(f"/instances/{instance_id}/step", json={"action": action})
                assert response.status_code in (200, 409), response.text
                if response.status_code == 409:  # the bandit's episode ended: start another
                    await http.post(f"/instances/{instance_id}/reset", json={})
                times.append(time.perf_counter() - began)
            return times

        calm = await latencies(trusted, "pull 1", 20) + await latencies(sandboxed, "guess 50", 20)
        began = time.monotonic()
        stuck = asyncio.create_task(
            http.post(f"/instances/{hung['instance_id']}/step", json={"action": action})
        )
        during: list[float] = []
        while not stuck.done():
            during += await latencies(trusted, "pull 1", 5) + await latencies(sandboxed, "guess 50", 5)
        elapsed = time.monotonic() - began
        message = assert_env_failed(await stuck, "step_timeout_s=2", "killed")
        assert STEP_TIMEOUT_S <= elapsed < STEP_TIMEOUT_S + 3, (elapsed, message)
        wait_until(lambda: not alive(hung["info"]["pid"]), "the hung instance's process to be killed", 10)
        assert (await http.get(f"/instances/{hung['instance_id']}")).status_code == 404
        # Dozens of steps went on while it hung. A spinning child takes one of two cores, so its
        # neighbours may slow, but none waits as long as the hang (a step queued behind it would):
        # under make test's parallel load one step once took 1.45 s, so the bound is the hang's.
        assert len(during) >= 20, during
        assert statistics.median(during) < max(10 * statistics.median(calm), 0.05), (calm, during)
        assert max(during) < STEP_TIMEOUT_S, during


def test_a_hung_reset_is_stopped_too(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        began = time.monotonic()
        response = http.post(
            "/instances", json={"env": HANGING, "seed": 1, "options": {"hang_in_reset": True}}
        )
        assert_env_failed(response, "a new instance", "step_timeout_s=2")
        assert time.monotonic() - began < STEP_TIMEOUT_S + 3
        assert all(i["env"] != HANGING for i in http.get("/instances").json()["instances"])


def test_a_crash_or_an_exception_ends_only_that_instance(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        crashing, _ = new_hanging(http)
        raising, raising_pid = new_hanging(http)
        bystander, _ = new_hanging(http)
        assert_env_failed(http.post(f"/instances/{crashing}/step", json={"action": "crash"}), "SIGSEGV")
        assert_env_failed(
            http.post(f"/instances/{raising}/step", json={"action": "raise"}), "ValueError: boom"
        )
        wait_until(lambda: not alive(raising_pid), "the failed instance's process to exit", 10)
        for gone in (crashing, raising):
            assert http.get(f"/instances/{gone}").status_code == 404
        assert http.post(f"/instances/{bystander}/step", json={"action": "still here"}).json()[
            "observation"
        ] == ("still here")
        http.delete(f"/instances/{bystander}")


def test_isolated_game_envs_play_exactly_as_in_process(
    server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``isolate=all`` moves the trusted envs into processes too; a seed's episode is unchanged."""
    isolated = serve(tmp_path_factory, ["game"], "isolated", isolate="all")
    try:
        episodes = []
        for url in (server.url, isolated.url):
            with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
                created = http.post("/instances", json={"env": "game/frozenlake", "seed": 7}).json()
                steps = [
                    created["observation"],
                    http.get(f"/instances/{created['instance_id']}/available_actions").json(),
                ]
                for action in ["Right", "Down", "Right", "Down", "Left", "Down"]:
                    response = http.post(f"/instances/{created['instance_id']}/step", json={"action": action})
                    steps.append(response.json() if response.status_code == 200 else response.status_code)
                episodes.append(steps)
        assert episodes[0] == episodes[1]
    finally:
        stop_server(isolated.process)


def test_no_instance_process_outlives_a_killed_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    doomed = serve(tmp_path_factory, USER_ENVS, "doomed", step_timeout_s=STEP_TIMEOUT_S)
    with httpx.Client(base_url=doomed.url, timeout=TIMEOUT) as http:
        pids = [new_hanging(http)[1] for _ in range(3)]
        spinning, spinning_pid = new_hanging(http)
        pids.append(spinning_pid)
        with pytest.raises(httpx.TimeoutException):  # a spinning child must die too
            http.post(f"/instances/{spinning}/step", json={"action": "spin"}, timeout=0.5)
    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(10)
    wait_until(lambda: not any(map(alive, pids)), "instance processes to die with their server", 10)
