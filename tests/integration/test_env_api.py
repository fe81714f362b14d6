"""The env HTTP API of docs/architecture.md against real uvicorn servers on free loopback ports.

Generic behaviour is shown with ``game/bandit``; properties every env must have (determinism by
seed, invalid actions as observations, no crosstalk) run for every env id the game server lists.
Servers with special settings (instance limit, body limit, token, TTL, a slow custom env) are
started per module with ``STARGYM_*`` variables.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import RunningServer, free_port, start_server, stop_server

from env_server.registry import registered_ids

GAME_ENV_IDS = [env_id for env_id in registered_ids() if env_id.startswith("game/")]
BANDIT = "game/bandit"
BANDIT_ONLY = ["--env", "env_server.envs.game.bandit:BanditEnv"]
SLOW_ENV = "tests/integration/custom_env.py:SlowEnv"
TIMEOUT = httpx.Timeout(30.0)
MISSING = str(uuid.UUID(int=0))


# ---------------------------------------------------------------- helpers and servers


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """The response is ``status`` with exactly ``{"error": {"code", "message"}}`` and no traceback."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"code", "message"}, body
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, body
    assert "Traceback" not in response.text and 'File "' not in response.text
    return error


def serve(tmp_path_factory, args: list[str], name: str, **settings: object) -> RunningServer:
    port = free_port()
    env = {f"STARGYM_{key.upper()}": str(value) for key, value in settings.items()}
    return start_server(
        ["env", "serve", *args, "--port", str(port)], port, tmp_path_factory.mktemp(name), env, name
    )


@pytest.fixture(scope="module")
def client(game_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=game_server.url, timeout=TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory) -> Iterator[RunningServer]:
    """Three instances at most, bodies of 1 KiB at most."""
    server = serve(tmp_path_factory, BANDIT_ONLY, "tight", max_instances=3, max_body_bytes=1024)
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory) -> Iterator[RunningServer]:
    server = serve(tmp_path_factory, BANDIT_ONLY, "auth", api_token="s3cret-token")
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory) -> Iterator[RunningServer]:
    """The game family plus a user's env whose resets block until the test lets them go."""
    server = serve(tmp_path_factory, ["game", "--env", SLOW_ENV], "slow")
    yield server
    stop_server(server.process)


def create(http: httpx.Client, env: str = BANDIT, seed: int | None = 0, **options: object) -> dict:
    body: dict = {"env": env, "seed": seed}
    if options:
        body["options"] = options
    response = http.post("/instances", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (labels must all match); fails if absent."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(\{.*\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"no sample {name}{labels} in /metrics")


# ---------------------------------------------------------------- metadata and lifecycle


def test_envs_lists_the_game_family_with_metadata(client: httpx.Client) -> None:
    response = client.get("/envs")
    assert response.status_code == 200
    envs = {spec["id"]: spec for spec in response.json()["envs"]}
    assert set(envs) == set(GAME_ENV_IDS) and BANDIT in envs
    for env_id, spec in envs.items():
        assert env_id == f"{spec['family']}/{spec['name']}"
        assert spec["family"] == "game"
        assert spec["instruction"] and spec["action_format"]
        assert spec["default_max_turns"] >= 1
        low, high = spec["reward_range"]
        assert low <= high
        # every env accepts the host's own option besides its own ones
        assert "max_actions_per_turn" in spec["options_schema"]["properties"]
    bandit_options = envs[BANDIT]["options_schema"]["properties"]
    assert {"safe_arm", "risky_arm", "risky_probability"} <= set(bandit_options)


def test_instance_lifecycle(client: httpx.Client) -> None:
    created = client.post("/instances", json={"env": BANDIT, "seed": 11})
    assert created.status_code == 201
    first = created.json()
    assert set(first) == {"instance_id", "observation", "info"}
    instance_id = first["instance_id"]
    assert str(uuid.UUID(instance_id)) == instance_id
    arms = first["info"]["arms"]
    assert sorted(arms) == ["Dragon", "Phoenix"]

    state = client.get(f"/instances/{instance_id}").json()
    assert state["instance_id"] == instance_id and state["env"] == BANDIT
    assert (state["seed"], state["options"], state["observation"]) == (11, {}, first["observation"])
    assert (state["done"], state["turns"], state["total_reward"]) == (False, 0, 0.0)
    assert state["created_at"] <= state["last_used_at"]

    actions = client.get(f"/instances/{instance_id}/available_actions")
    assert actions.status_code == 200 and actions.json() == arms

    step = client.post(f"/instances/{instance_id}/step", json={"action": "Phoenix"})
    assert step.status_code == 200
    result = step.json()
    assert set(result) == {"observation", "reward", "done", "info"}
    assert result["done"] is True and result["reward"] == pytest.approx(0.15)
    assert result["info"]["valid"] is True and result["info"]["success"] is False
    state = client.get(f"/instances/{instance_id}").json()
    assert (state["done"], state["turns"], state["observation"]) == (True, 1, result["observation"])
    assert state["total_reward"] == pytest.approx(0.15)

    # reset without a body, and with an empty one: same seed, same first observation
    for kwargs in ({}, {"json": {}}):
        again = client.post(f"/instances/{instance_id}/reset", **kwargs)
        assert again.status_code == 200, again.text
        assert again.json() == {"observation": first["observation"], "info": first["info"]}
        state = client.get(f"/instances/{instance_id}").json()
        assert (state["seed"], state["done"], state["turns"], state["total_reward"]) == (11, False, 0, 0.0)
        client.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}).raise_for_status()

    # reset with a seed gives what a fresh instance with that seed gives
    for seed in range(6):
        reset = client.post(f"/instances/{instance_id}/reset", json={"seed": seed})
        assert reset.status_code == 200
        fresh = create(client, seed=seed)
        assert reset.json() == {"observation": fresh["observation"], "info": fresh["info"]}
        assert client.delete(f"/instances/{fresh['instance_id']}").status_code == 204
        assert client.get(f"/instances/{instance_id}").json()["seed"] == seed

    listed = client.get("/instances").json()
    assert instance_id in {item["instance_id"] for item in listed["instances"]}
    assert listed["count"] == len(listed["instances"]) and listed["limit"] >= listed["count"]

    deleted = client.delete(f"/instances/{instance_id}")
    assert deleted.status_code == 204 and deleted.content == b""
    assert_error(client.get(f"/instances/{instance_id}"), 404, "not_found")
    assert_error(client.delete(f"/instances/{instance_id}"), 404, "not_found")
    assert instance_id not in {item["instance_id"] for item in client.get("/instances").json()["instances"]}


def test_reset_keeps_options_unless_given(client: httpx.Client) -> None:
    first = create(client, seed=3, safe_arm="Gold", risky_arm="Lottery")
    instance_id = first["instance_id"]
    assert sorted(first["info"]["arms"]) == ["Gold", "Lottery"]

    kept = client.post(f"/instances/{instance_id}/reset", json={"seed": 4}).json()
    assert sorted(kept["info"]["arms"]) == ["Gold", "Lottery"]
    assert client.get(f"/instances/{instance_id}").json()["options"] == {
        "safe_arm": "Gold",
        "risky_arm": "Lottery",
    }

    replaced = client.post(f"/instances/{instance_id}/reset", json={"options": {"safe_arm": "Coin"}}).json()
    assert sorted(replaced["info"]["arms"]) == ["Coin", "Dragon"]
    state = client.get(f"/instances/{instance_id}").json()
    assert (state["options"], state["seed"]) == ({"safe_arm": "Coin"}, 4)

    # invalid options at reset: 422, and the instance keeps what it had
    assert_error(
        client.post(f"/instances/{instance_id}/reset", json={"options": {"safe_arm": "X", "risky_arm": "x"}}),
        422,
        "invalid_options",
    )
    assert client.get(f"/instances/{instance_id}").json()["options"] == {"safe_arm": "Coin"}
    client.delete(f"/instances/{instance_id}")


@pytest.mark.parametrize("env_id", GAME_ENV_IDS)
def test_every_env_lifecycle_and_invalid_action(client: httpx.Client, env_id: str) -> None:
    """Any env: create, inspect, an invalid action is an observation (info.valid False), reset, close."""
    first = create(client, env_id, seed=5)
    instance_id = first["instance_id"]
    assert isinstance(first["observation"], str) and first["observation"]
    assert isinstance(first["info"], dict)
    state = client.get(f"/instances/{instance_id}").json()
    assert (state["env"], state["seed"], state["observation"]) == (env_id, 5, first["observation"])

    actions = client.get(f"/instances/{instance_id}/available_actions")
    assert actions.status_code == 200
    assert actions.json() is None or all(isinstance(action, str) for action in actions.json())

    step = client.post(f"/instances/{instance_id}/step", json={"action": "xyzzy 42 ~~ not an action"})
    assert step.status_code == 200, step.text
    result = step.json()
    assert result["info"].get("valid") is False, result
    assert isinstance(result["reward"], float) and isinstance(result["done"], bool)
    assert client.get(f"/instances/{instance_id}").json()["turns"] == 1

    if actions.json():
        step = client.post(f"/instances/{instance_id}/step", json={"action": actions.json()[0]})
        if not result["done"]:
            assert step.status_code == 200, step.text
            assert step.json()["info"].get("valid", True) is True

    reset = client.post(f"/instances/{instance_id}/reset")
    assert reset.status_code == 200
    assert reset.json() == {"observation": first["observation"], "info": first["info"]}
    assert client.delete(f"/instances/{instance_id}").status_code == 204


# ---------------------------------------------------------------- bad input


def test_unknown_env_is_404(client: httpx.Client) -> None:
    error = assert_error(client.post("/instances", json={"env": "game/nope"}), 404, "not_found")
    assert "game/nope" in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/instances/{id}", None),
        ("DELETE", "/instances/{id}", None),
        ("POST", "/instances/{id}/step", {"action": "Dragon"}),
        ("POST", "/instances/{id}/reset", {}),
        ("POST", "/instances/{id}/reset", None),
        ("GET", "/instances/{id}/available_actions", None),
    ],
)
@pytest.mark.parametrize("instance_id", [MISSING, "not-a-uuid"])
def test_unknown_instance_is_404(client, method: str, path: str, body, instance_id: str) -> None:
    response = client.request(method, path.format(id=instance_id), json=body)
    error = assert_error(response, 404, "not_found")
    assert instance_id in error["message"]


@pytest.mark.parametrize(
    ("path", "content"),
    [
        ("/instances", b'{"env": "game/bandit", '),  # malformed JSON
        ("/instances", b"not json at all"),
        ("/instances", b"[1, 2]"),  # JSON, but not an object
        ("/instances", b""),  # no body
        ("/instances", b"{}"),  # missing field
        ("/instances", b'{"env": "game/bandit", "colour": "red"}'),  # extra field
        ("/instances", b'{"env": 5}'),  # wrong types
        ("/instances", b'{"env": "game/bandit", "seed": "abc"}'),
        ("/instances", b'{"env": "game/bandit", "seed": 1.5}'),
        ("/instances", b'{"env": "game/bandit", "options": [1]}'),
        ("/instances", b'{"env": "game/bandit", "seed": -1}'),  # negative seed
        ("/instances", b'{"env": "game/bandit", "seed": 9223372036854775808}'),  # 2**63
        ("/instances", b'{"env": "game/bandit", "seed": true}'),  # JSON types as the schema has them:
        ("/instances", b'{"env": "game/bandit", "seed": "5"}'),  # pydantic's lax mode took these two
        ("/instances/{id}/step", b"{}"),
        ("/instances/{id}/step", b'{"action": 3}'),
        ("/instances/{id}/step", b'{"action": "Dragon", "extra": 1}'),
        ("/instances/{id}/step", b'{"action": "Drag'),
        ("/instances/{id}/reset", b'{"seed": -5}'),
        ("/instances/{id}/reset", b'{"seed": "x"}'),
        ("/instances/{id}/reset", b'{"sed": 1}'),
        ("/instances/{id}/reset", b'{"options": "x"}'),
        ("/instances/{id}/reset", b'{"seed": false}'),
        ("/instances/step", b'{"steps": [{"instance_id": "x"}]}'),
        ("/instances/step", b'{"steps": {}}'),
        ("/instances/step", b"[]"),
    ],
)
def test_bad_bodies_are_422(client: httpx.Client, path: str, content: bytes) -> None:
    instance_id = create(client)["instance_id"]
    response = client.post(
        path.format(id=instance_id), content=content, headers={"content-type": "application/json"}
    )
    assert_error(response, 422, "validation_error")
    # the instance was not touched by the failed call
    state = client.get(f"/instances/{instance_id}").json()
    assert (state["turns"], state["seed"], state["done"]) == (0, 0, False)
    client.delete(f"/instances/{instance_id}")


@pytest.mark.parametrize(
    "options",
    [
        {"colour": "red"},  # unknown to the env
        {"risky_probability": 2},  # out of range
        {"safe_arm": ""},
        {"safe_arm": "Same", "risky_arm": "same"},  # the env's own cross-field check
        {"safe_payout": "lots"},
        {"max_actions_per_turn": 0},  # the host's option
        {"max_actions_per_turn": "two"},
        {"risky_probability": False},  # JSON types as the env's schema has them (lax mode took these)
        {"safe_payout": "0.5"},
        {"max_actions_per_turn": True},
    ],
)
def test_invalid_options_are_422(client: httpx.Client, options: dict) -> None:
    before = client.get("/instances").json()["count"]
    error = assert_error(
        client.post("/instances", json={"env": BANDIT, "options": options}), 422, "invalid_options"
    )
    assert BANDIT in error["message"]
    assert client.get("/instances").json()["count"] == before


def test_whole_numbers_written_as_floats_are_integers(client: httpx.Client) -> None:
    """JSON Schema's integer includes 4.0: a seed or an integer option may be written so."""
    created = client.post(
        "/instances", json={"env": BANDIT, "seed": 4.0, "options": {"max_actions_per_turn": 2.0}}
    )
    assert created.status_code == 201, created.text
    instance_id = created.json()["instance_id"]
    assert client.get(f"/instances/{instance_id}").json()["seed"] == 4
    assert client.post(f"/instances/{instance_id}/reset", json={"seed": 6.0}).status_code == 200
    assert client.get(f"/instances/{instance_id}").json()["seed"] == 6
    client.delete(f"/instances/{instance_id}")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("OPTIONS", "/instances", "GET, POST"),  # two routes: Starlette named the first one's methods
        ("PUT", f"/instances/{MISSING}", "DELETE, GET"),
        ("GET", "/instances/step", "POST"),  # not an instance id: it was "instance 'step' does not exist"
        ("DELETE", "/instances/step", "POST"),
    ],
)
def test_a_405_allows_every_method_of_its_path(
    client: httpx.Client, method: str, path: str, allowed: str
) -> None:
    response = client.request(method, path)
    assert_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == allowed


def test_step_after_done_is_409(client: httpx.Client) -> None:
    instance_id = create(client)["instance_id"]
    assert client.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}).json()["done"]
    assert_error(
        client.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}), 409, "episode_done"
    )
    assert client.get(f"/instances/{instance_id}").json()["turns"] == 1
    client.post(f"/instances/{instance_id}/reset").raise_for_status()
    assert client.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}).status_code == 200
    client.delete(f"/instances/{instance_id}")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("PUT", "/instances"),
        ("DELETE", "/envs"),
        ("GET", "/instances/{id}/step"),
        ("PATCH", "/instances/{id}"),
        ("GET", "/instances/{id}/reset"),
        ("POST", "/health"),
    ],
)
def test_wrong_method_is_405(client: httpx.Client, method: str, path: str) -> None:
    response = client.request(method, path.format(id=MISSING))
    assert_error(response, 405, "method_not_allowed")
    assert "allow" in response.headers


def test_unknown_route_is_404(client: httpx.Client) -> None:
    assert_error(client.get("/no/such/route"), 404, "not_found")


def test_instance_limit_is_429(tight_server: RunningServer) -> None:
    with httpx.Client(base_url=tight_server.url, timeout=TIMEOUT) as http:
        assert http.get("/instances").json()["limit"] == 3
        ids = [create(http, seed=seed)["instance_id"] for seed in range(3)]
        error = assert_error(http.post("/instances", json={"env": BANDIT}), 429, "instance_limit")
        assert "3" in error["message"]
        # a bad request still answers its own error past the limit, and the limit frees on delete
        assert_error(http.post("/instances", json={"env": "game/nope"}), 404, "not_found")
        assert http.delete(f"/instances/{ids[0]}").status_code == 204
        ids[0] = create(http)["instance_id"]
        assert_error(http.post("/instances", json={"env": BANDIT}), 429, "instance_limit")
        assert http.get("/instances").json()["count"] == 3
        for instance_id in ids:
            assert http.delete(f"/instances/{instance_id}").status_code == 204


def _padded_create(size: int) -> bytes:
    """A valid create body of exactly ``size`` bytes (JSON whitespace pads it)."""
    body = b'{"env": "game/bandit", "seed": 1}'
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_oversized_body_is_413(tight_server: RunningServer) -> None:
    with httpx.Client(base_url=tight_server.url, timeout=TIMEOUT) as http:
        fits = http.post(
            "/instances", content=_padded_create(1024), headers={"content-type": "application/json"}
        )
        assert fits.status_code == 201, fits.text
        http.delete(f"/instances/{fits.json()['instance_id']}")

        error = assert_error(http.post("/instances", content=_padded_create(1025)), 413, "payload_too_large")
        assert "1024" in error["message"]
        assert_error(
            http.post(f"/instances/{MISSING}/step", json={"action": "x" * 5000}), 413, "payload_too_large"
        )
        assert http.get("/instances").json()["count"] == 0


def test_oversized_chunked_body_is_413(tight_server: RunningServer) -> None:
    """No Content-Length: the limit counts what arrives."""

    def chunks(body: bytes, size: int = 200) -> Iterator[bytes]:
        for start in range(0, len(body), size):
            yield body[start : start + size]

    with httpx.Client(base_url=tight_server.url, timeout=TIMEOUT) as http:
        headers = {"content-type": "application/json"}
        small = http.post("/instances", content=chunks(_padded_create(1000)), headers=headers)
        assert small.request.headers.get("transfer-encoding") == "chunked"
        assert small.status_code == 201, small.text
        http.delete(f"/instances/{small.json()['instance_id']}")

        large = http.post("/instances", content=chunks(_padded_create(3000)), headers=headers)
        assert large.request.headers.get("transfer-encoding") == "chunked"
        assert_error(large, 413, "payload_too_large")
        assert http.get("/instances").json()["count"] == 0


def test_default_body_limit_is_one_mib(client: httpx.Client) -> None:
    error = assert_error(
        client.post(f"/instances/{MISSING}/step", json={"action": "x" * (1024 * 1024)}),
        413,
        "payload_too_large",
    )
    assert str(1024 * 1024) in error["message"]
    # just under the limit is read and answered on its merits (unknown instance)
    assert_error(client.post(f"/instances/{MISSING}/step", json={"action": "x" * 1000_000}), 404, "not_found")


def test_bearer_token(auth_server: RunningServer) -> None:
    with httpx.Client(base_url=auth_server.url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200  # open without a token
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Bearer s3cret-token-and-more"},
            {"Authorization": "Bearer s3cret-toke"},
            {"Authorization": "s3cret-token"},
            {"Authorization": "Basic s3cret-token"},
        ):
            for method, path in (
                ("POST", "/instances"),
                ("GET", "/envs"),
                ("GET", "/metrics"),
                ("GET", "/docs"),
            ):
                response = http.request(method, path, headers=headers, json={"env": BANDIT})
                assert_error(response, 401, "unauthorized")
                assert response.headers["www-authenticate"] == "Bearer"
        assert "missing" in http.get("/envs").json()["error"]["message"]
        assert http.get("/instances").json()["error"]["code"] == "unauthorized"

        good = {"Authorization": "Bearer s3cret-token"}
        created = http.post("/instances", json={"env": BANDIT, "seed": 1}, headers=good)
        assert created.status_code == 201
        instance_id = created.json()["instance_id"]
        assert http.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}, headers=good).is_success
        assert_error(
            http.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}), 401, "unauthorized"
        )
        assert http.get("/metrics", headers=good).status_code == 200
        assert http.delete(f"/instances/{instance_id}", headers=good).status_code == 204


# ---------------------------------------------------------------- batched steps


def test_batched_step_mixes_results_and_errors_in_order(client: httpx.Client) -> None:
    a = create(client, seed=1)["instance_id"]
    b = create(client, seed=2)["instance_id"]
    steps = [
        {"instance_id": a, "action": "nonsense"},
        {"instance_id": MISSING, "action": "Dragon"},
        {"instance_id": b, "action": "Phoenix"},
        {"instance_id": a, "action": "Phoenix"},
        {"instance_id": a, "action": "Dragon"},
        {"instance_id": b, "action": "Phoenix"},
    ]
    response = client.post("/instances/step", json={"steps": steps})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [item["instance_id"] for item in results] == [step["instance_id"] for step in steps]

    def outcome(item: dict) -> tuple:
        assert (item["result"] is None) != (item["error"] is None), item
        if item["error"]:
            return ("error", item["error"]["code"])
        return ("ok", item["result"]["done"], item["result"]["info"]["valid"])

    assert [outcome(item) for item in results] == [
        ("ok", False, False),  # a: invalid arm, episode goes on
        ("error", "not_found"),
        ("ok", True, True),  # b: done
        ("ok", True, True),  # a: its second step, applied after its first
        ("error", "episode_done"),  # a: its third, after the episode ended
        ("error", "episode_done"),
    ]
    assert results[3]["result"]["reward"] == pytest.approx(0.15)
    state = client.get(f"/instances/{a}").json()
    assert (state["turns"], state["done"]) == (2, True)
    assert client.post("/instances/step", json={"steps": []}).json() == {"results": []}
    for instance_id in (a, b):
        client.delete(f"/instances/{instance_id}")


def test_batched_steps_of_one_instance_apply_in_order(slow_server: RunningServer) -> None:
    """Steps of one slow (threaded) instance run one after another, in the order given."""
    with httpx.Client(base_url=slow_server.url, timeout=TIMEOUT) as http:
        ids = [
            create(http, "test/slow", seed=s, step_delay_s=0.01, episode_length=4)["instance_id"]
            for s in range(3)
        ]
        steps = [{"instance_id": ids[i % 3], "action": f"a{i}"} for i in range(15)]
        results = http.post("/instances/step", json={"steps": steps}).json()["results"]
        for index, item in enumerate(results):
            turn = index // 3 + 1
            if turn <= 4:
                assert item["result"]["observation"] == f"step {turn}: a{index}", item
                assert item["result"]["done"] is (turn == 4)
                assert item["result"]["info"]["overlapped"] is False
            else:
                assert item["error"]["code"] == "episode_done"
        for instance_id in ids:
            http.delete(f"/instances/{instance_id}")


# ---------------------------------------------------------------- multi-action turns


@pytest.mark.parametrize(
    ("max_actions", "reply", "done", "valid", "executed", "invalid", "reward"),
    [
        (2, "nonsense || Phoenix", True, False, 2, 1, 0.15),
        (2, "Phoenix || Dragon", True, True, 1, 0, 0.15),  # stops when the episode ends
        (2, "foo || bar || Phoenix", False, False, 2, 2, 0.0),  # at most two actions
        (3, "foo || bar || Phoenix", True, False, 3, 2, 0.15),
        (2, "  Phoenix  ||", True, True, 1, 0, 0.15),
    ],
)
def test_multi_action_turns(client, max_actions, reply, done, valid, executed, invalid, reward) -> None:
    instance_id = create(client, seed=2, max_actions_per_turn=max_actions)["instance_id"]
    result = client.post(f"/instances/{instance_id}/step", json={"action": reply}).json()
    info = result["info"]
    assert (result["done"], info["valid"], info["actions_executed"], info["invalid_actions"]) == (
        done,
        valid,
        executed,
        invalid,
    )
    assert result["reward"] == pytest.approx(reward)
    assert client.get(f"/instances/{instance_id}").json()["turns"] == 1
    client.delete(f"/instances/{instance_id}")


def test_one_action_per_turn_by_default(client: httpx.Client) -> None:
    instance_id = create(client, seed=2)["instance_id"]
    result = client.post(f"/instances/{instance_id}/step", json={"action": "nonsense || Phoenix"}).json()
    assert (result["done"], result["info"]["valid"]) == (False, False)
    assert "actions_executed" not in result["info"]
    client.delete(f"/instances/{instance_id}")


# ---------------------------------------------------------------- determinism and concurrency


def async_client(server: RunningServer, connections: int = 16) -> httpx.AsyncClient:
    """Requests beyond ``connections`` queue in the client: httpx's pool costs the client far more
    CPU per request with hundreds of connections, and the server sees ``connections`` in flight."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits)


class Sequential:
    """A sync client behind the async client's methods: one request at a time, nothing concurrent."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    async def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)

    async def get(self, path: str, **kwargs) -> httpx.Response:
        return self.http.get(path, **kwargs)

    async def delete(self, path: str, **kwargs) -> httpx.Response:
        return self.http.delete(path, **kwargs)


async def _close_all(http: httpx.AsyncClient, ids: list[str]) -> None:
    responses = await asyncio.gather(*(http.delete(f"/instances/{i}") for i in ids))
    assert all(response.status_code == 204 for response in responses)


@pytest.mark.parametrize("env_id", GAME_ENV_IDS)
async def test_same_seed_same_observation_under_concurrency(game_server: RunningServer, env_id: str) -> None:
    async with async_client(game_server) as http:
        responses = await asyncio.gather(
            *(http.post("/instances", json={"env": env_id, "seed": 1234}) for _ in range(64))
        )
        assert all(response.status_code == 201 for response in responses)
        created = [response.json() for response in responses]
        assert len({item["instance_id"] for item in created}) == 64
        assert len({(item["observation"], repr(item["info"])) for item in created}) == 1
        await _close_all(http, [item["instance_id"] for item in created])

        responses = await asyncio.gather(
            *(http.post("/instances", json={"env": env_id, "seed": seed}) for seed in range(16))
        )
        different = {response.json()["observation"] for response in responses}
        assert len(different) > 1, f"{env_id}: 16 seeds gave one observation"
        await _close_all(http, [response.json()["instance_id"] for response in responses])


def _script_action(actions: list[str] | None, seed: int, turn: int) -> str:
    """A reproducible action for ``seed`` at ``turn``: from the available ones, or a fixed fallback."""
    if actions:
        return actions[(seed * 7 + turn * 3) % len(actions)]
    return ["look", "inventory", "go north", "get 1 stick"][(seed + turn) % 4]


async def _play(
    http: httpx.AsyncClient | Sequential, env_id: str, seed: int, turns: int, options: dict, action: str = ""
) -> list:
    """Create, take up to ``turns`` actions (``action``, or scripted ones); returns the id and what was seen."""
    response = await http.post("/instances", json={"env": env_id, "seed": seed, "options": options})
    assert response.status_code == 201, response.text
    instance_id = response.json()["instance_id"]
    seen: list = [response.json()["observation"]]
    for turn in range(turns):
        if not action:
            actions = (await http.get(f"/instances/{instance_id}/available_actions")).json()
        chosen = action or _script_action(actions, seed, turn)
        step = await http.post(f"/instances/{instance_id}/step", json={"action": chosen})
        assert step.status_code == 200, step.text
        result = step.json()
        seen.append((chosen, result["observation"], result["reward"], result["done"]))
        if result["done"]:
            break
    return [instance_id, *seen]


def _close_sync(server: RunningServer, runs: list[list]) -> list[list]:
    """Close the instances of ``runs`` (one request at a time: cheaper than async for the client)
    and return the runs without their ids."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for run in runs:
            assert http.delete(f"/instances/{run[0]}").status_code == 204
    return [run[1:] for run in runs]


async def test_200_bandits_concurrently_no_crosstalk(game_server: RunningServer) -> None:
    options = {"risky_probability": 0.5}
    async with async_client(game_server) as http:
        together = await asyncio.gather(*(_play(http, BANDIT, s, 1, options, "Dragon") for s in range(200)))
    together = _close_sync(game_server, together)
    # the risky arm's outcome depends on each instance's own RNG: both outcomes occur
    assert {run[-1][2] for run in together} == {0.0, 1.0}
    with httpx.Client(base_url=game_server.url, timeout=TIMEOUT) as http:
        alone = [await _play(Sequential(http), BANDIT, s, 1, options, "Dragon") for s in range(200)]
    assert together == _close_sync(game_server, alone)


async def test_every_env_concurrently_no_crosstalk(game_server: RunningServer) -> None:
    """Instances of every env, interleaved, see exactly what each sees when played alone."""
    runs = [(env_id, seed) for env_id in GAME_ENV_IDS for seed in range(12)]
    async with async_client(game_server) as http:
        together = await asyncio.gather(*(_play(http, env_id, seed, 3, {}) for env_id, seed in runs))
    together = _close_sync(game_server, together)
    with httpx.Client(base_url=game_server.url, timeout=TIMEOUT) as http:
        alone = [await _play(Sequential(http), env_id, seed, 3, {}) for env_id, seed in runs]
    alone = _close_sync(game_server, alone)
    for (env_id, seed), mixed, single in zip(runs, together, alone, strict=True):
        assert mixed == single, f"{env_id} seed {seed}"


async def test_concurrent_steps_on_one_instance_are_serialised(
    game_server: RunningServer, slow_server: RunningServer
) -> None:
    async with async_client(game_server) as http:
        for seed in range(20):
            instance_id = (await http.post("/instances", json={"env": BANDIT, "seed": seed})).json()[
                "instance_id"
            ]
            responses = await asyncio.gather(
                *(http.post(f"/instances/{instance_id}/step", json={"action": "Dragon"}) for _ in range(2))
            )
            assert sorted(response.status_code for response in responses) == [200, 409]
            state = (await http.get(f"/instances/{instance_id}")).json()
            assert state["turns"] == 1
            await http.delete(f"/instances/{instance_id}")

    # an env on worker threads: without the instance lock, these steps would overlap in the env
    async with async_client(slow_server) as http:
        created = await http.post(
            "/instances",
            json={"env": "test/slow", "seed": 0, "options": {"step_delay_s": 0.05, "episode_length": 1}},
        )
        instance_id = created.json()["instance_id"]
        responses = await asyncio.gather(
            *(http.post(f"/instances/{instance_id}/step", json={"action": str(i)}) for i in range(4))
        )
        assert sorted(response.status_code for response in responses) == [200, 409, 409, 409]
        ok = next(response.json() for response in responses if response.status_code == 200)
        assert ok["info"] == {"valid": True, "steps": 1, "overlapped": False}

        await http.post(
            f"/instances/{instance_id}/reset", json={"options": {"step_delay_s": 0.02, "episode_length": 8}}
        )
        responses = await asyncio.gather(
            *(http.post(f"/instances/{instance_id}/step", json={"action": str(i)}) for i in range(8))
        )
        assert all(response.status_code == 200 for response in responses)
        infos = [response.json()["info"] for response in responses]
        assert sorted(info["steps"] for info in infos) == list(range(1, 9))
        assert not any(info["overlapped"] for info in infos)
        await http.delete(f"/instances/{instance_id}")


async def _blocked_call_does_not_stall_others(
    http: httpx.AsyncClient, tmp_path: Path, start_blocked, blocked_id: str | None
) -> None:
    """Start a call that blocks in env code until a gate file exists, then step other instances."""
    started, gate = tmp_path / "started", tmp_path / "gate"
    gated = {"started_file": str(started), "gate_file": str(gate)}
    others = [
        (await http.post("/instances", json={"env": env, "seed": seed})).json()["instance_id"]
        for seed, env in enumerate([BANDIT] * 4 + ["test/slow"] * 4)
    ]
    blocked = asyncio.create_task(start_blocked(gated))
    try:
        deadline = time.monotonic() + 20
        while not started.exists():
            assert time.monotonic() < deadline, "the gated call never reached the env"
            assert not blocked.done(), blocked.result().text
            await asyncio.sleep(0.01)

        completed = 0
        for round_ in range(5):
            responses = await asyncio.gather(
                *(http.post(f"/instances/{i}/reset", json={"seed": round_}) for i in others),
                http.post("/instances", json={"env": "test/slow", "seed": round_}),
            )
            responses += await asyncio.gather(
                *(http.post(f"/instances/{i}/step", json={"action": "Dragon"}) for i in others)
            )
            assert all(response.is_success for response in responses), [r.text for r in responses]
            completed += len(responses)
            others.append(responses[len(others)].json()["instance_id"])
            if blocked_id is not None:  # the blocked instance still answers reads meanwhile
                assert (await http.get(f"/instances/{blocked_id}")).status_code == 200
        assert completed == sum(2 * (8 + r) + 1 for r in range(5))
        assert not blocked.done(), "the gated call finished before its gate opened"

        if blocked_id is not None:  # a step on the blocked instance waits for its reset
            waiting_step = asyncio.create_task(
                http.post(f"/instances/{blocked_id}/step", json={"action": "x"})
            )
            await asyncio.sleep(0)
        gate.write_text("open")
        response = await asyncio.wait_for(blocked, timeout=30)
        assert response.is_success, response.text
        if blocked_id is not None:
            step = await asyncio.wait_for(waiting_step, timeout=30)
            assert step.status_code == 200 and step.json()["info"]["steps"] == 1
    finally:
        gate.write_text("open")
        await asyncio.wait_for(asyncio.gather(blocked, return_exceptions=True), timeout=30)
    await _close_all(http, others)


async def test_slow_reset_does_not_stall_other_instances(slow_server: RunningServer, tmp_path: Path) -> None:
    async with async_client(slow_server) as http:
        slow_id = (await http.post("/instances", json={"env": "test/slow", "seed": 9})).json()["instance_id"]

        def reset(options: dict):
            return http.post(f"/instances/{slow_id}/reset", json={"seed": 10, "options": options})

        await _blocked_call_does_not_stall_others(http, tmp_path, reset, slow_id)
        state = (await http.get(f"/instances/{slow_id}")).json()
        assert state["seed"] == 10
        await http.delete(f"/instances/{slow_id}")


async def test_slow_create_does_not_stall_other_instances(slow_server: RunningServer, tmp_path: Path) -> None:
    async with async_client(slow_server) as http:

        def create_blocked(options: dict):
            return http.post("/instances", json={"env": "test/slow", "seed": 1, "options": options})

        before = (await http.get("/instances")).json()["count"]
        await _blocked_call_does_not_stall_others(http, tmp_path, create_blocked, None)
        assert (await http.get("/instances")).json()["count"] == before + 1


# ---------------------------------------------------------------- reaper, metrics, docs


async def test_reaper_frees_idle_instances(tmp_path_factory, tmp_path: Path) -> None:
    """Idle instances go, a busy one (its lock held by a blocked reset) stays; the gauges follow.

    Nothing here depends on timing but the wait for the reaper: the busy instance cannot be reaped
    however slow the machine, and each /metrics scrape is consistent within itself.
    """
    server = serve(
        tmp_path_factory,
        [*BANDIT_ONLY, "--env", SLOW_ENV],
        "reaper",
        instance_ttl_s=0.5,
        reaper_interval_s=0.05,
    )
    started, gate = tmp_path / "started", tmp_path / "gate"
    gated = {"started_file": str(started), "gate_file": str(gate)}
    created = 0
    busy = None

    async def instance_ids(http: httpx.AsyncClient) -> set[str]:
        return {item["instance_id"] for item in (await http.get("/instances")).json()["instances"]}

    async def metrics(http: httpx.AsyncClient) -> tuple[float, float]:
        text = (await http.get("/metrics")).text
        return metric(text, "env_instances"), metric(text, "env_instances_reaped")

    try:
        async with async_client(server) as http, asyncio.timeout(30):
            while True:  # a kept instance, busy in a reset that blocks until the gate opens
                kept = (await http.post("/instances", json={"env": "test/slow", "seed": 0})).json()[
                    "instance_id"
                ]
                created += 1
                busy = asyncio.create_task(http.post(f"/instances/{kept}/reset", json={"options": gated}))
                while not started.exists() and not busy.done():
                    await asyncio.sleep(0.01)
                if started.exists():
                    break
                assert busy.result().status_code == 404, busy.result().text  # reaped first: again

            idle = []
            for seed in range(3):
                idle.append(
                    (await http.post("/instances", json={"env": BANDIT, "seed": seed})).json()["instance_id"]
                )
                created += 1
            live, reaped = await metrics(http)
            assert live >= 1 and live + reaped == created

            while await instance_ids(http) & set(idle):
                await asyncio.sleep(0.02)
            assert await instance_ids(http) == {kept}
            for instance_id in idle:
                response = await http.post(f"/instances/{instance_id}/step", json={"action": "Dragon"})
                assert_error(response, 404, "not_found")
            assert await metrics(http) == (1, created - 1)

            gate.write_text("open")
            assert (await busy).status_code == 200
            while (await http.get("/instances")).json()["count"]:
                await asyncio.sleep(0.02)
            assert await metrics(http) == (0, created)
    finally:
        gate.write_text("open")
        if busy is not None:
            await asyncio.gather(busy, return_exceptions=True)
        stop_server(server.process)


def test_metrics_count_requests(client: httpx.Client) -> None:
    def created_201() -> float:
        try:
            return metric(
                client.get("/metrics").text,
                "http_requests_total",
                method="POST",
                route="/instances",
                status="201",
            )
        except AssertionError:
            return 0.0

    before = created_201()
    ids = [create(client, seed=seed)["instance_id"] for seed in range(3)]
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE http_requests_total counter" in response.text
    assert created_201() == before + 3
    # routes are labelled by template, never by instance id
    client.get(f"/instances/{ids[0]}")
    text = client.get("/metrics").text
    assert (
        metric(text, "http_requests_total", method="GET", route="/instances/{instance_id}", status="200") >= 1
    )
    assert ids[0] not in text
    assert metric(text, "env_instances") >= 3
    assert metric(text, "http_request_duration_seconds_count", route="/instances") >= 3
    for instance_id in ids:
        client.delete(f"/instances/{instance_id}")


def test_fast_and_routed_steps_answer_and_count_alike(client: httpx.Client) -> None:
    """A plain step is answered before routing (env_server/step_fast_path.py), one whose content
    type is another JSON type (``+json``, which FastAPI reads as JSON) by the route: the same
    answers, statuses and errors, and every one counted under the step route's template."""
    template = "/instances/{instance_id}/step"

    def steps_counted(status: str) -> float:
        text = client.get("/metrics").text
        try:
            return metric(text, "http_requests_total", method="POST", route=template, status=status)
        except AssertionError:
            return 0.0

    fast = create(client, seed=3)["instance_id"]
    routed = create(client, seed=3)["instance_id"]
    before = {status: steps_counted(status) for status in ("200", "404", "409")}
    answers = []
    for instance_id, headers in (
        (fast, {"content-type": "application/json"}),
        (routed, {"content-type": "application/vnd.api+json"}),
    ):
        pair = []
        for action in ("nonsense", "Dragon", "Dragon"):  # refused, the episode's end, then 409
            body = orjson.dumps({"action": action})
            pair.append(client.post(f"/instances/{instance_id}/step", content=body, headers=headers))
        answers.append(pair)
    for fast_answer, routed_answer in zip(*answers, strict=True):
        assert fast_answer.status_code == routed_answer.status_code
        assert fast_answer.text.replace(fast, "<id>") == routed_answer.text.replace(routed, "<id>")
        assert fast_answer.headers["content-type"] == routed_answer.headers["content-type"]
    assert [answer.status_code for answer in answers[0]] == [200, 200, 409]
    assert_error(client.post(f"/instances/{MISSING}/step", json={"action": "Dragon"}), 404, "not_found")
    assert steps_counted("200") == before["200"] + 4
    assert steps_counted("409") == before["409"] + 2
    assert steps_counted("404") == before["404"] + 1


def test_docs_and_openapi(client: httpx.Client) -> None:
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path, method in [
        ("/health", "get"),
        ("/metrics", "get"),
        ("/envs", "get"),
        ("/instances", "post"),
        ("/instances", "get"),
        ("/instances/step", "post"),
        ("/instances/{instance_id}", "get"),
        ("/instances/{instance_id}", "delete"),
        ("/instances/{instance_id}/step", "post"),
        ("/instances/{instance_id}/reset", "post"),
        ("/instances/{instance_id}/available_actions", "get"),
    ]:
        assert method in paths.get(path, {}), f"{method.upper()} {path} missing from /openapi.json"
    assert "201" in paths["/instances"]["post"]["responses"]
