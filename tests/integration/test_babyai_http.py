"""BabyAI over HTTP: a scripted agent that reads only the text solves levels; AgentGym's routes; bad input.

The agent sees what any client sees: observations with their action lists. Where the text
offers the winning action (``go to red ball 1``, ``toggle and go through`` a locked door with
its key) it takes it; otherwise it asks minigrid's ``BabyAIBot`` on a local twin of the level
(same id, same seed) for its next primitive move and sends that move as a text action. Each
twin move is the move the server makes, so the server's reward must equal the twin's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import gymnasium
import httpx
import pytest
from conftest import RunningServer, free_port, start_server, stop_server
from minigrid.utils.baby_ai_bot import BabyAIBot

ENV = "embodied/babyai"
TIMEOUT = httpx.Timeout(30.0)
AHEAD = re.compile(r"There is a ([a-z]+(?: [a-z]+)* \d+) right in front of you 1 steps away\.")
MOVE_NAMES = {0: "turn left", 1: "turn right", 2: "move forward", 4: "drop", 5: "toggle"}
PICKUP, DONE = 3, 6
MOST_TURNS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The class path rather than the family: the server hosts BabyAI alone.
    port = free_port()
    args = ["env", "serve", "--env", "env_server.envs.embodied.babyai:BabyAIEnv", "--port", str(port)]
    running = start_server(args, port, Path(tmp_path_factory.mktemp("babyai")), name="babyai")
    yield running
    stop_server(running.process)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        yield http


def listed(observation: str) -> list[str]:
    return json.loads(observation.rsplit("Available actions: ", 1)[1])


class TextAgent:
    """Chooses text actions from observations alone, with the bot on a twin for the legwork."""

    def __init__(self, level: str, seed: int, shortcut: re.Pattern[str]) -> None:
        self.twin = gymnasium.make(level).unwrapped
        self.twin.reset(seed=seed)
        self.bot = BabyAIBot(self.twin)
        self.shortcut = shortcut
        self.last_move: int | None = None
        self.twin_reward = 0.0

    def act(self, observation: str) -> tuple[str, bool]:
        """The next action, and whether the twin made the same move (False for a shortcut)."""
        winning = [action for action in listed(observation) if self.shortcut.fullmatch(action)]
        if winning:
            return winning[0], False
        move = int(self.bot.replan(self.last_move))
        assert move != DONE, "the bot thinks the mission is done but the server does not"
        _, self.twin_reward, *_ = self.twin.step(move)
        self.last_move = move
        if move == PICKUP:
            return f"pick up {AHEAD.search(observation)[1]}", True
        return MOVE_NAMES[move], True


def solve(client: httpx.Client, level: str, seed: int, shortcut: str = "(?!)") -> tuple[dict, int, bool]:
    """Play one episode; the last step, the number of turns, whether it ended on a shortcut."""
    created = client.post("/instances", json={"env": ENV, "seed": seed, "options": {"level": level}})
    assert created.status_code == 201, created.text
    instance_id, observation = created.json()["instance_id"], created.json()["observation"]
    agent = TextAgent(level, seed, re.compile(shortcut))
    for turn in range(1, MOST_TURNS + 1):
        action, twinned = agent.act(observation)
        response = client.post(f"/instances/{instance_id}/step", json={"action": action})
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["info"]["valid"], (action, result["observation"])
        if twinned:
            assert result["reward"] == agent.twin_reward
        if result["done"]:
            after = client.post(f"/instances/{instance_id}/step", json={"action": "turn left"})
            assert after.status_code == 409 and after.json()["error"]["code"] == "episode_done"
            assert client.delete(f"/instances/{instance_id}").status_code == 204
            return result, turn, not twinned
        observation = result["observation"]
    raise AssertionError(f"{level} seed {seed} not solved in {MOST_TURNS} turns")


@pytest.mark.parametrize(
    ("level", "shortcut"),
    [
        ("BabyAI-GoToRedBall-v0", r"go to red ball 1"),
        ("BabyAI-PickupLoc-v0", r"(?!)"),
        ("BabyAI-UnlockLocal-v0", r"toggle and go through \w+ locked door 1"),
    ],
)
def test_a_text_agent_solves_the_level(client: httpx.Client, level: str, shortcut: str) -> None:
    shortcuts = 0
    for seed in range(6):
        result, _, took_shortcut = solve(client, level, seed, shortcut)
        assert result["info"]["success"] and 0.0 < result["reward"] <= 1.0
        assert result["observation"].split("\n")[-2] == "The task is completed."
        shortcuts += took_shortcut
    if shortcut != "(?!)":
        assert shortcuts > 0, "the high-level action never won"


def test_a_maze_level_with_doors_is_solved_move_by_move(client: httpx.Client) -> None:
    result, turns, _ = solve(client, "BabyAI-GoToObjMazeS7-v0", 1)
    assert result["info"]["success"] and turns > 10


def test_unparseable_actions_are_observations_not_errors(client: httpx.Client) -> None:
    created = client.post("/instances", json={"env": ENV, "seed": 0}).json()
    response = client.post(f"/instances/{created['instance_id']}/step", json={"action": "Thought: hmm"})
    assert response.status_code == 200
    result = response.json()
    assert (result["reward"], result["done"], result["info"]["valid"]) == (0.0, False, False)
    assert result["observation"].startswith("The action is not recognized. Please check valid actions.")
    actions = client.get(f"/instances/{created['instance_id']}/available_actions").json()
    assert actions == listed(result["observation"])
    client.delete(f"/instances/{created['instance_id']}")


@pytest.mark.parametrize(
    "options",
    [{"level": "BabyAI-NoSuchLevel-v0"}, {"level": 41}, {"level": [2]}, {"levels": 2}],
)
def test_unknown_levels_and_malformed_options_are_422(client: httpx.Client, options: dict) -> None:
    response = client.post("/instances", json={"env": ENV, "seed": 0, "options": options})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_options"


def test_agentgym_client_sequence_maps_data_idx_to_level_and_seed(client: httpx.Client) -> None:
    """What ``agentenv.envs.BabyAIEnvClient`` sends: create without a body, reset, step, close."""
    base = "/agentgym/babyai"
    created = client.post(f"{base}/create")
    assert created.status_code == 200
    env_id = created.json()["id"]

    data_idx = 41  # AgentGym-RL: level 41 % 40 + 1 = 2 (GoToRedBall), seed 41 // 40 = 1
    reset = client.post(f"{base}/reset", json={"id": env_id, "data_idx": data_idx}).json()
    native = client.post("/instances", json={"env": ENV, "seed": 1, "options": {"level": 2}}).json()
    assert reset["observation"] == native["observation"]
    assert reset["observation"].startswith("Your goal: go to the red ball\n")
    client.delete(f"/instances/{native['instance_id']}")
    assert client.get(f"{base}/observation?id={env_id}").json() == reset["observation"]
    actions = client.get(f"{base}/available_actions?id={env_id}").json()
    assert actions == listed(reset["observation"])

    agent = TextAgent("BabyAI-GoToRedBall-v0", 1, re.compile("go to red ball 1"))
    observation, score = reset["observation"], 0.0
    for _ in range(MOST_TURNS):
        action, _ = agent.act(observation)
        step = client.post(f"{base}/step", json={"id": env_id, "action": action}).json()
        assert set(step) == {"observation", "reward", "score", "done"}
        score += step["reward"]
        assert step["score"] == pytest.approx(score)
        observation = step["observation"]
        if step["done"]:
            break
    assert step["done"] and step["score"] > 0
    assert client.post(f"{base}/close", json={"id": env_id}).json() is True
