"""The AgentGym routes answer exactly what AgentGym's unmodified env clients send and read.

The requests below replay ``agentenv.envs.TextCraftEnvClient`` (the client AgentGym-RL trains
with) and ``BabyAIEnvClient`` / ``SciworldEnvClient`` call for call: the same paths, bodies
and query strings (built by string formatting, as they build them), and each response is
checked for exactly the fields those clients read. AgentGym's clients use ``requests``; the
wire is the same with httpx.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import RunningServer
from textcraft_planner import plan

TIMEOUT = httpx.Timeout(30.0)
CREATED_KEYS = {"id", "observation", "reward", "done"}
RESET_KEYS = {"id", "observation", "reward", "score", "done", "task_description"}
STEP_KEYS = {"observation", "reward", "score", "done"}


@pytest.fixture(scope="module")
def client(game_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def base(game_server: RunningServer) -> str:
    return game_server.url


class AgentGymCalls:
    """The HTTP calls of AgentGym's env clients, with their status checks (they assert 200)."""

    def __init__(self, client: httpx.Client, env_server_base: str) -> None:
        self.client = client
        self.env_server_base = env_server_base
        self.env_id: str = ""

    def create(self, **body: object) -> dict:
        # TextCraft's client posts json={"minecraft_dir", "commands", "goal"}; BabyAI's no body.
        kwargs = {"json": body} if body else {}
        response = self.client.post(f"{self.env_server_base}/create", **kwargs)
        assert response.status_code == 200, response.text
        created = response.json()
        self.env_id = created["id"]
        return created

    def post(self, path: str, data: dict) -> object:
        data["id"] = self.env_id
        response = self.client.post(f"{self.env_server_base}/{path}", json=data)
        assert response.status_code == 200, response.text
        return response.json()

    def get(self, path: str) -> object:
        response = self.client.get(f"{self.env_server_base}/{path}?id={self.env_id}")
        assert response.status_code == 200, response.text
        return response.json()


def test_textcraft_client_sequence_solves_a_task(client: httpx.Client, base: str) -> None:
    calls = AgentGymCalls(client, f"{base}/agentgym/textcraft")
    created = calls.create(minecraft_dir="agentenv_textcraft/", commands=None, goal=None)
    assert set(created) == CREATED_KEYS and isinstance(created["observation"], str)
    assert str(uuid.UUID(created["id"])) == created["id"]

    reset = calls.post("reset", {"data_idx": 17})
    assert set(reset) == RESET_KEYS
    assert (reset["id"], reset["reward"], reset["score"], reset["done"]) == (calls.env_id, 0.0, 0.0, False)
    native = client.post(f"{base}/instances", json={"env": "game/textcraft", "seed": 17}).json()
    assert reset["observation"] == native["observation"], "data_idx is the seed"
    assert calls.get("observation") == reset["observation"]
    assert calls.get("available_actions") == []

    actions = plan(reset["observation"])
    for turn, action in enumerate(actions):
        result = calls.post("step", {"action": action})
        assert set(result) == STEP_KEYS
        last = turn == len(actions) - 1
        assert (result["reward"], result["score"], result["done"]) == (float(last), float(last), last)
    assert calls.get("observation") == result["observation"]

    state = client.get(f"{base}/instances/{calls.env_id}").json()
    assert (state["turns"], state["total_reward"]) == (len(actions), 1.0), "one instance, two route sets"
    assert calls.post("close", {}) is True
    assert client.get(f"{base}/instances/{calls.env_id}").status_code == 404


def test_babyai_style_client_sequence_plays_the_bandit(client: httpx.Client, base: str) -> None:
    calls = AgentGymCalls(client, f"{base}/agentgym/bandit")
    created = calls.create()
    assert set(created) == CREATED_KEYS
    reset = calls.post("reset", {"data_idx": 3})
    assert set(reset) == RESET_KEYS
    arms = calls.get("available_actions")
    assert sorted(arms) == ["Dragon", "Phoenix"]
    assert calls.get("observation") == reset["observation"]
    result = calls.post("step", {"action": "Phoenix"})
    assert result == {
        "observation": "You pulled Phoenix and won 0.15.",
        "reward": 0.15,
        "score": 0.15,
        "done": True,
    }
    again = calls.post("reset", {"data_idx": 3})
    assert again["observation"] == reset["observation"] and again["score"] == 0.0
    assert calls.post("close", {}) is True


def test_reset_defaults_to_data_idx_0_and_extra_fields_are_ignored(client: httpx.Client, base: str) -> None:
    calls = AgentGymCalls(client, f"{base}/agentgym/textcraft")
    created = calls.create(minecraft_dir="elsewhere/", unknown="ignored, as AgentGym's servers do")
    assert calls.post("reset", {"extra": 1})["observation"] == created["observation"]
    calls.post("close", {})


def test_unknown_ids_are_404(client: httpx.Client, base: str) -> None:
    textcraft = f"{base}/agentgym/textcraft"
    unknown = str(uuid.uuid4())
    responses = [
        client.post(f"{textcraft}/step", json={"id": unknown, "action": "inventory"}),
        client.post(f"{textcraft}/reset", json={"id": unknown, "data_idx": 0}),
        client.get(f"{textcraft}/observation?id={unknown}"),
        client.get(f"{textcraft}/available_actions?id={unknown}"),
        client.post(f"{textcraft}/close", json={"id": unknown}),
        client.post(f"{base}/agentgym/no-such-env/create", json={}),
    ]
    for response in responses:
        assert response.status_code == 404, (response.request.url, response.text)
        assert set(response.json()["error"]) == {"code", "message"}
        assert response.json()["error"]["code"] == "not_found"


def test_an_instance_of_one_env_is_unknown_to_another(client: httpx.Client, base: str) -> None:
    calls = AgentGymCalls(client, f"{base}/agentgym/bandit")
    calls.create()
    textcraft = f"{base}/agentgym/textcraft"
    responses = [
        client.post(f"{textcraft}/step", json={"id": calls.env_id, "action": "Dragon"}),
        client.post(f"{textcraft}/reset", json={"id": calls.env_id, "data_idx": 0}),
        client.get(f"{textcraft}/observation?id={calls.env_id}"),
        client.post(f"{textcraft}/close", json={"id": calls.env_id}),
    ]
    assert [response.status_code for response in responses] == [404] * 4
    assert calls.post("step", {"action": "Dragon"})["done"] is True, "the bandit was left untouched"
    calls.post("close", {})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("step", {"action": "inventory"}),
        ("step", {"id": "x"}),
        ("step", {"id": ["x"], "action": "inventory"}),
        ("step", {"id": "x", "action": 3}),
        ("reset", {"id": "x", "data_idx": "first"}),
        ("reset", {"id": "x", "data_idx": -1}),
        ("close", {}),
        ("create", {"goal": "minecraft:stick", "commands": "craft 4 stick using 2 planks"}),
        ("create", {"commands": 5}),
    ],
)
def test_malformed_bodies_are_422(client: httpx.Client, base: str, path: str, body: dict) -> None:
    response = client.post(f"{base}/agentgym/textcraft/{path}", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "validation_error"
    assert set(response.json()["error"]) == {"code", "message"}


def test_a_body_that_is_not_json_is_422(client: httpx.Client, base: str) -> None:
    response = client.post(
        f"{base}/agentgym/textcraft/step", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


def test_observation_without_id_is_422(client: httpx.Client, base: str) -> None:
    response = client.get(f"{base}/agentgym/textcraft/observation")
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


def test_step_after_done_is_409_until_reset(client: httpx.Client, base: str) -> None:
    calls = AgentGymCalls(client, f"{base}/agentgym/bandit")
    calls.create()
    calls.post("step", {"action": "Dragon"})
    response = client.post(f"{base}/agentgym/bandit/step", json={"id": calls.env_id, "action": "Dragon"})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "episode_done"
    calls.post("reset", {"data_idx": 0})
    assert set(calls.post("step", {"action": "Dragon"})) == STEP_KEYS
    calls.post("close", {})
