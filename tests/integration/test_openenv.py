"""OpenEnv's protocol on a real env server, driven by OpenEnv's own unmodified client.

``GenericEnvClient`` (openenv-core, a test dependency) plays whole episodes over ``/openenv/…/ws``;
raw WebSockets check what its client hides: error codes, dropped sockets, the instance limit, the
reaper and the API token.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from conftest import REPO_ROOT, RunningServer, free_port, start_server, stop_server, wait_until
from openenv.core.generic_client import GenericEnvClient
from reasoning_answers import reasoning_gym_item
from solvers import solve_frozenlake
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from deploy.integrations.trl import environment_factory, episode_reward

TOKEN = "openenv-test-token"


def ws_url(server: RunningServer, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def send(ws: ClientConnection, message: dict | str) -> dict:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=30))


def instance_count(server: RunningServer, headers: dict[str, str] | None = None) -> int:
    return httpx.get(f"{server.url}/instances", headers=headers, timeout=10).json()["count"]


def test_openenvs_client_plays_a_game_to_the_end(game_server: RunningServer) -> None:
    before = instance_count(game_server)
    client = GenericEnvClient(base_url=f"{game_server.url}/openenv/game/frozenlake", message_timeout_s=30)
    with client.sync() as env:
        first = env.reset(seed=5)
        assert first.done is False and first.reward is None
        plan = solve_frozenlake(first.observation["text"])
        assert plan, first.observation
        assert instance_count(game_server) == before + 1
        for turn, action in enumerate(plan):
            result = env.step({"text": action})
            assert result.observation["info"]["valid"], result
            assert result.done == (turn == len(plan) - 1)
        assert (result.reward, result.observation["info"]["success"]) == (1.0, True)
        state = env.state()
        assert (state["env"], state["seed"], state["step_count"], state["done"]) == (
            "game/frozenlake",
            5,
            len(plan),
            True,
        )
        # The same seed is the same episode; no seed, a new one (OpenEnv's reset semantics).
        assert env.reset(seed=5).observation == first.observation
        seeds = {env.reset().observation["text"] for _ in range(6)}
        assert len(seeds) > 1
    wait_until(lambda: instance_count(game_server) == before, "the closed session's instance to go", 10)


def test_one_socket_picks_and_switches_envs_by_reset_option(game_server: RunningServer) -> None:
    with GenericEnvClient(base_url=f"{game_server.url}/openenv", message_timeout_s=30).sync() as env:
        bandit = env.reset(env="game/bandit", seed=2, options={"safe_arm": "Lion"})
        assert "Lion" in bandit.observation["text"]
        assert env.step({"text": "Lion"}).reward == pytest.approx(0.15)
        lake = env.reset(env="game/frozenlake", seed=1, options={"size": 5})
        assert len(lake.observation["text"].splitlines()) == 6  # 5 rows and the goal line
        assert env.state()["env"] == "game/frozenlake"
        assert instance_count(game_server) >= 1


def test_errors_carry_openenvs_codes_and_keep_the_session(game_server: RunningServer) -> None:
    with connect(ws_url(game_server, "/openenv/game/bandit/ws"), open_timeout=10) as ws:
        assert send(ws, "{not json")["data"]["code"] == "INVALID_JSON"
        assert send(ws, {"type": "jump"})["data"]["code"] == "UNKNOWN_TYPE"
        early = send(ws, {"type": "step", "data": {"text": "Dragon"}})
        assert early["type"] == "error" and early["data"]["code"] == "EXECUTION_ERROR"
        bad_options = send(ws, {"type": "reset", "data": {"options": {"risky_probability": 3}}})
        assert bad_options["data"]["code"] == "VALIDATION_ERROR"
        assert "risky_probability" in bad_options["data"]["message"]
        assert bad_options["data"]["reason"] == "invalid_options"
        unknown_field = send(ws, {"type": "reset", "data": {"seeed": 1}})
        assert (
            unknown_field["data"]["code"] == "VALIDATION_ERROR"
            and "seeed" in unknown_field["data"]["message"]
        )
        unknown_env = send(ws, {"type": "reset", "data": {"env": "game/chess"}})
        assert (
            unknown_env["data"]["code"] == "VALIDATION_ERROR"
            and "game/chess" in unknown_env["data"]["message"]
        )
        bad_action = send(ws, {"type": "step", "data": {"action": "Dragon"}})
        assert bad_action["data"]["code"] == "VALIDATION_ERROR"
        assert send(ws, {"type": "state"})["data"]["instance_id"] is None
        # After all that the session still plays.
        reset = send(ws, {"type": "reset", "data": {"seed": 4}})
        assert reset["type"] == "observation" and reset["data"]["done"] is False
        done = send(ws, {"type": "step", "data": {"text": "Dragon"}})
        assert done["data"]["done"] is True
        again = send(ws, {"type": "step", "data": {"text": "Dragon"}})
        assert (again["data"]["code"], again["data"]["reason"]) == ("EXECUTION_ERROR", "episode_done")
    with connect(ws_url(game_server, "/openenv/game/chess/ws"), open_timeout=10) as ws:
        refused = json.loads(ws.recv(timeout=10))
        assert refused["data"]["code"] == "FACTORY_ERROR"


def test_a_dropped_socket_frees_its_instance(game_server: RunningServer) -> None:
    before = instance_count(game_server)
    with connect(ws_url(game_server, "/openenv/game/sokoban/ws"), open_timeout=10) as ws:
        assert send(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
        assert instance_count(game_server) == before + 1
        ws.socket.shutdown(socket.SHUT_RDWR)  # no close frame, no "close" message: the client vanished
        wait_until(lambda: instance_count(game_server) == before, "the dropped session's instance to go", 10)


def test_the_http_side_of_openenv(game_server: RunningServer) -> None:
    with httpx.Client(base_url=game_server.url, timeout=10) as http:
        assert http.get("/openenv/game/sokoban/health").json() == {"status": "healthy"}
        schemas = http.get("/openenv/game/sokoban/schema").json()
        assert schemas["action"]["required"] == ["text"]
        assert {"text", "info", "done", "reward"} <= set(schemas["observation"]["properties"])
        assert {"episode_id", "step_count"} <= set(schemas["state"]["properties"])
        metadata = http.get("/openenv/game/sokoban/metadata").json()
        assert metadata["name"] == "game/sokoban" and "box" in metadata["description"].lower()
        everything = http.get("/openenv/metadata").json()
        assert "game/frozenlake" in everything["description"]
        for route in ("schema", "health"):  # an env's health too: it once answered for any name
            missing = http.get(f"/openenv/game/chess/{route}")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A game server with an API token, room for one instance and a one-second idle TTL."""
    port = free_port()
    settings = {
        "STARGYM_API_TOKEN": TOKEN,
        "STARGYM_MAX_INSTANCES": "1",
        "STARGYM_INSTANCE_TTL_S": "1",
        "STARGYM_REAPER_INTERVAL_S": "0.2",
    }
    server = start_server(
        ["env", "serve", "game", "--port", str(port)],
        port,
        tmp_path_factory.mktemp("strict"),
        env=settings,
        name="strict-game",
    )
    yield server
    stop_server(server.process)


def test_sessions_count_against_the_instance_limit(strict_server: RunningServer) -> None:
    url = ws_url(strict_server, "/openenv/game/bandit/ws")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with connect(url, additional_headers=auth, open_timeout=10) as first:
        assert send(first, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
        with connect(url, additional_headers=auth, open_timeout=10) as second:
            full = send(second, {"type": "reset", "data": {"seed": 1}})
            assert full["data"]["code"] == "CAPACITY_REACHED"
            refused = httpx.post(
                f"{strict_server.url}/instances", json={"env": "game/bandit"}, headers=auth, timeout=10
            )
            assert refused.status_code == 429
            first.send(json.dumps({"type": "close"}))  # OpenEnv's close: no answer, the server hangs up
            wait_until(lambda: instance_count(strict_server, auth) == 0, "the closed session's instance", 10)
            assert send(second, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def test_the_reaper_closes_an_idle_sessions_instance(strict_server: RunningServer) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with connect(ws_url(strict_server, "/openenv/game/bandit/ws"), additional_headers=auth) as ws:
        send(ws, {"type": "reset", "data": {"seed": 3, "options": {"risky_arm": "Tiger"}}})
        wait_until(
            lambda: instance_count(strict_server, auth) == 0, "the reaper to close the idle instance", 10
        )
        expired = send(ws, {"type": "step", "data": {"text": "Tiger"}})
        assert (expired["data"]["code"], expired["data"]["reason"]) == ("EXECUTION_ERROR", "instance_expired")
        # A reset starts over with the session's options.
        again = send(ws, {"type": "reset", "data": {"seed": 3}})
        assert "Tiger" in again["data"]["observation"]["text"]


def test_a_session_needs_the_api_token(strict_server: RunningServer) -> None:
    url = ws_url(strict_server, "/openenv/game/bandit/ws")
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=10)
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus):
        connect(url, additional_headers={"Authorization": "Bearer wrong"}, open_timeout=10)
    with connect(f"{url}?token={TOKEN}", open_timeout=10) as ws:
        assert send(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def test_trls_environment_factory_plays_an_episode_to_its_reward(game_server: RunningServer) -> None:
    make_env = environment_factory(game_server.url, env="game/frozenlake", options={"size": 4})
    environments = [make_env(), make_env()]  # TRL makes one per rollout slot
    assert [
        name
        for name in dir(environments[0])
        if callable(getattr(environments[0], name)) and not name.startswith("_")
    ] == ["act", "reset"]  # TRL's tools: every public method but reset
    for seed, env in zip((5, 6), environments, strict=True):
        prompt = env.reset(seed=seed, prompt=[{"role": "user", "content": "play"}])
        assert prompt.startswith(env.instruction) and "Reach G" in prompt
        for action in solve_frozenlake(prompt.removeprefix(env.instruction).strip()):
            reply = env.act(action)
        assert env.done and "episode is over" in reply
        with pytest.raises(ValueError, match="episode is over"):
            env.act("left")
    assert episode_reward(environments) == [1.0, 1.0]
    environments[0].reset(seed=5)
    assert (environments[0].reward, environments[0].done, environments[0].turns) == (0.0, False, 0)


def test_the_environment_factory_passes_the_api_token(strict_server: RunningServer) -> None:
    env = environment_factory(strict_server.url, env="game/bandit", token=TOKEN)()
    assert "arms" in env.reset(seed=1)
    assert "You pulled" in env.act("Dragon")
    with pytest.raises(httpx.HTTPStatusError):
        environment_factory(strict_server.url, env="game/bandit")()


def test_the_readmes_trl_example_plays_to_the_first_reward(game_server: RunningServer) -> None:
    """The README's TRL block, run as written but for the server's address."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("<!-- readme-example: trl -->\n```python\n", 1)[1].split("```", 1)[0]
    assert 'ENV_SERVER = "http://localhost:8101"' in block
    namespace: dict = {}
    exec(block.replace("http://localhost:8101", game_server.url), namespace)
    env = namespace["env"]
    assert env.done and env.turns == 1
    assert namespace["episode_reward"]([env]) in ([0.0], [1.0])


def test_openenvs_client_plays_a_reasoning_task_to_the_end(reasoning_server: RunningServer) -> None:
    gold = reasoning_gym_item("basic_arithmetic", 11)["answer"]
    base = f"{reasoning_server.url}/openenv/reasoning/basic_arithmetic"
    with GenericEnvClient(base_url=base, message_timeout_s=60).sync() as env:
        first = env.reset(seed=11, options={"max_attempts": 2})
        assert first.observation["text"] == reasoning_gym_item("basic_arithmetic", 11)["question"]
        wrong = env.step({"text": f"{gold}1"})
        assert (wrong.done, wrong.reward) == (False, 0.0) and "Try again" in wrong.observation["text"]
        right = env.step({"text": f"<answer>{gold}</answer>"})
        assert (right.done, right.reward, right.observation["info"]["success"]) == (True, 1.0, True)
        assert env.state()["step_count"] == 2
