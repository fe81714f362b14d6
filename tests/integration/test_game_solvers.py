"""Generated grid levels are solvable through the HTTP API: BFS on the observation text, then play it.

The solvers see only what an agent sees (the grid in the observation), so reaching success also
proves the text shows the real state. Both route sets are exercised: the native instance API for
several seeds and options, the AgentGym routes once per env.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from conftest import RunningServer
from solvers import solve_frozenlake, solve_sokoban

SEEDS = range(6)
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def client(game_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=game_server.url, timeout=TIMEOUT) as http:
        yield http


def create(client: httpx.Client, env: str, seed: int, options: dict) -> dict:
    response = client.post("/instances", json={"env": env, "seed": seed, "options": options})
    assert response.status_code == 201, response.text
    return response.json()


def play(client: httpx.Client, instance_id: str, plan: list[str]) -> list[dict]:
    """Send the plan one action a turn; every turn but the last must leave the episode running."""
    results = []
    for turn, action in enumerate(plan):
        response = client.post(f"/instances/{instance_id}/step", json={"action": action})
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["info"]["valid"], result
        assert result["done"] == (turn == len(plan) - 1), (turn, result)
        results.append(result)
    return results


@pytest.mark.parametrize(
    "options", [{}, {"size": 6}, {"random_start_goal": True}, {"size": 5, "random_start_goal": True}]
)
@pytest.mark.parametrize("seed", SEEDS)
def test_frozenlake_bfs_reaches_the_goal(client: httpx.Client, seed: int, options: dict) -> None:
    created = create(client, "game/frozenlake", seed, options)
    plan = solve_frozenlake(created["observation"])
    assert plan, created["observation"]
    results = play(client, created["instance_id"], plan)
    assert [r["reward"] for r in results] == [0.0] * (len(plan) - 1) + [1.0]
    assert results[-1]["info"]["success"] is True
    state = client.get(f"/instances/{created['instance_id']}").json()
    assert state["done"] and state["total_reward"] == 1.0


@pytest.mark.parametrize("options", [{}, {"num_boxes": 2, "dim": [7, 7]}, {"dim": [6, 8]}])
@pytest.mark.parametrize("seed", SEEDS)
def test_sokoban_bfs_solves_the_room(client: httpx.Client, seed: int, options: dict) -> None:
    created = create(client, "game/sokoban", seed, options)
    plan = solve_sokoban(created["observation"])
    assert plan, created["observation"]
    results = play(client, created["instance_id"], plan)
    assert results[-1]["info"]["success"] is True
    num_boxes = options.get("num_boxes", 1)
    assert results[-1]["info"]["boxes_on_target"] == num_boxes
    # Each box lands on a target once more than it leaves one; every step costs 0.1.
    expected = -0.1 * len(plan) + (num_boxes - created["info"]["boxes_on_target"]) + 10
    assert sum(r["reward"] for r in results) == pytest.approx(expected)
    assert results[-1]["reward"] == pytest.approx(-0.1 + 1 + 10)


@pytest.mark.parametrize(("name", "solve"), [("frozenlake", solve_frozenlake), ("sokoban", solve_sokoban)])
def test_agentgym_routes_solve_a_level(
    client: httpx.Client, name: str, solve: Callable[[str], list[str] | None]
) -> None:
    base = f"/agentgym/{name}"
    instance_id = client.post(f"{base}/create", json={}).json()["id"]
    reset = client.post(f"{base}/reset", json={"id": instance_id, "data_idx": 11})
    assert reset.status_code == 200, reset.text
    observation = client.get(f"{base}/observation", params={"id": instance_id}).json()
    assert observation == reset.json()["observation"]
    native = create(client, f"game/{name}", 11, {})
    assert observation == native["observation"], "data_idx is the seed"
    plan = solve(observation)
    assert plan
    for turn, action in enumerate(plan):
        result = client.post(f"{base}/step", json={"id": instance_id, "action": action}).json()
        assert {"observation", "reward", "done"} <= set(result)
        assert result["done"] == (turn == len(plan) - 1)
    assert result["reward"] == pytest.approx(1.0 if name == "frozenlake" else 10.9)
    assert client.post(f"{base}/close", json={"id": instance_id}).status_code == 200
