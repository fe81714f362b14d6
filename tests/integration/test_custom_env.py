"""A user's env written in one file (tests/integration/custom_env.py), served and played over HTTP.

``stargym env serve --env FILE.py:Class`` and ``--env package.module:Class`` both serve it; bad
``--env`` values stop the command with a clear message and a non-zero exit; ``python -m
env_server`` starts the same server as ``stargym env serve``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import REPO_ROOT, STARGYM, RunningServer, free_port, start_server, stop_server, wait_healthy

CUSTOM_FILE = "tests/integration/custom_env.py"
CUSTOM_MODULE = "tests.integration.custom_env"
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(
    scope="module", params=[f"{CUSTOM_FILE}:MyEnv", f"{CUSTOM_MODULE}:MyEnv"], ids=["file", "module"]
)
def custom_server(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[RunningServer]:
    port = free_port()
    server = start_server(
        ["env", "serve", "--env", request.param, "--port", str(port)],
        port,
        tmp_path_factory.mktemp("custom"),
        name="custom",
    )
    yield server
    stop_server(server.process)


def guess_the_number(http: httpx.Client, instance_id: str, high: int) -> tuple[int, dict]:
    """Binary search over HTTP; returns the number of guesses and the last step's result."""
    low, turns = 1, 0
    while True:
        middle = (low + high) // 2
        response = http.post(f"/instances/{instance_id}/step", json={"action": f"guess {middle}"})
        assert response.status_code == 200, response.text
        result = response.json()
        turns += 1
        if result["done"]:
            return turns, result
        assert result["observation"] in {"higher", "lower"}, result
        low, high = (middle + 1, high) if result["observation"] == "higher" else (low, middle - 1)
        assert low <= high and turns < 40, "the hints contradict each other"


def test_custom_env_is_served_and_played(custom_server: RunningServer) -> None:
    with httpx.Client(base_url=custom_server.url, timeout=TIMEOUT) as http:
        envs = http.get("/envs").json()["envs"]
        assert [spec["id"] for spec in envs] == ["custom/guess"]
        assert envs[0]["action_format"] == "guess N" and envs[0]["default_max_turns"] == 20
        assert {"max_number", "max_actions_per_turn"} <= set(envs[0]["options_schema"]["properties"])

        created = http.post(
            "/instances", json={"env": "custom/guess", "seed": 7, "options": {"max_number": 1000}}
        )
        assert created.status_code == 201, created.text
        instance_id = created.json()["instance_id"]
        assert created.json()["info"] == {"max_number": 1000}

        invalid = http.post(f"/instances/{instance_id}/step", json={"action": "is it 5?"}).json()
        assert invalid["info"]["valid"] is False and invalid["done"] is False

        turns, result = guess_the_number(http, instance_id, 1000)
        assert result["reward"] == 1.0 and result["info"]["success"] is True
        assert turns <= 10  # log2(1000)
        secret = int(result["observation"].split()[0])
        state = http.get(f"/instances/{instance_id}").json()
        assert (state["done"], state["turns"], state["total_reward"]) == (True, turns + 1, 1.0)
        assert http.post(f"/instances/{instance_id}/step", json={"action": "guess 1"}).status_code == 409

        # the same seed and options pick the same number again; the options were kept on reset
        http.post(f"/instances/{instance_id}/reset").raise_for_status()
        again = http.post(f"/instances/{instance_id}/step", json={"action": f"guess {secret}"}).json()
        assert again["done"] is True and again["reward"] == 1.0

        bad = http.post("/instances", json={"env": "custom/guess", "options": {"max_number": 0}})
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_options"
        assert http.delete(f"/instances/{instance_id}").status_code == 204


def test_custom_env_alongside_a_family(tmp_path) -> None:
    port = free_port()
    server = start_server(
        ["env", "serve", "game", "--env", f"{CUSTOM_FILE}:MyEnv", "--port", str(port)], port, tmp_path
    )
    try:
        envs = {spec["id"] for spec in httpx.get(f"{server.url}/envs", timeout=TIMEOUT).json()["envs"]}
        assert {"custom/guess", "game/bandit"} <= envs
    finally:
        stop_server(server.process)


def _normalise(text: str) -> str:
    """The CLI's error box, as one line: no box-drawing characters, single spaces."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


BAD_ENV_ARGS = {
    "missing file": (["--env", "tests/integration/no_such_file.py:MyEnv"], "does not exist"),
    "no class part": (["--env", CUSTOM_FILE], "must look like 'package.module:Class'"),
    "missing module": (
        ["--env", "no_such_package_xyz.envs:MyEnv"],
        "cannot import 'no_such_package_xyz.envs'",
    ),
    "missing class": (["--env", f"{CUSTOM_MODULE}:NoSuchEnv"], "has no attribute 'NoSuchEnv'"),
    "not an Env": (["--env", f"{CUSTOM_FILE}:NotAnEnv"], "is not a subclass of env_server.Env"),
    "no metadata": (["--env", f"{CUSTOM_MODULE}:NoMetadataEnv"], "lacks class metadata: name, family"),
    "unknown family": (["no_such_family"], "no registered env in family 'no_such_family'"),
    "nothing": ([], "nothing to serve"),
}


def test_bad_env_values_fail_clearly(tmp_path) -> None:
    broken = tmp_path / "broken_env.py"
    broken.write_text("def broken(:\n")
    raising = tmp_path / "raising_env.py"
    raising.write_text("raise RuntimeError('the env module failed')\n")
    cases = {
        **BAD_ENV_ARGS,
        "syntax error": (["--env", f"{broken}:MyEnv"], "SyntaxError"),
        "module raises": (["--env", f"{raising}:MyEnv"], "RuntimeError: the env module failed"),
    }
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    port = str(free_port())  # nothing may listen on it: each command must fail before serving
    processes = {
        name: subprocess.Popen(
            [*STARGYM, "env", "serve", *args, "--port", port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO_ROOT,
            text=True,
        )
        for name, (args, _) in cases.items()
    }
    try:
        for name, process in processes.items():
            out, err = process.communicate(timeout=60)
            message = _normalise(out + err)
            assert process.returncode not in (0, None), f"{name}: exit {process.returncode}"
            assert cases[name][1] in message, f"{name}: {message}"
            assert "Traceback" not in out + err, f"{name}: {err}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_python_m_env_server_starts_a_server(tmp_path) -> None:
    port = free_port()
    log_path = tmp_path / "python-m.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "env_server", "game", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, process)
        except Exception:
            pytest.fail(f"python -m env_server did not start:\n{log_path.read_text(errors='replace')}")
        envs = {spec["id"] for spec in httpx.get(f"{url}/envs", timeout=TIMEOUT).json()["envs"]}
        assert "game/bandit" in envs and all(env_id.startswith("game/") for env_id in envs)
        created = httpx.post(f"{url}/instances", json={"env": "game/bandit", "seed": 1}, timeout=TIMEOUT)
        assert created.status_code == 201
    finally:
        stop_server(process)
