"""TextCraft over the native HTTP API: tasks solved from their text, determinism under concurrent creates."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import RunningServer, create_instance
from textcraft_planner import plan

ENV = "game/textcraft"
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def client(game_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=game_server.url, timeout=TIMEOUT) as http:
        yield http


def create(client: httpx.Client, seed: int, options: dict | None = None) -> dict:
    return create_instance(client, ENV, seed, options)


@pytest.mark.parametrize(
    "options", [{}, {"min_depth": 1, "max_depth": 1}, {"min_depth": 3}, {"min_depth": 4}]
)
@pytest.mark.parametrize("seed", [0, 1, 7, 42, 1234])
def test_planner_crafts_the_goal(client: httpx.Client, seed: int, options: dict) -> None:
    created = create(client, seed, options)
    assert options.get("min_depth", 2) <= created["info"]["depth"] <= options.get("max_depth", 4)
    instance_id = created["instance_id"]
    actions = plan(created["observation"])
    for turn, action in enumerate(actions):
        response = client.post(f"/instances/{instance_id}/step", json={"action": action})
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["info"]["valid"] and "failure" not in result["info"], (action, result)
        last = turn == len(actions) - 1
        assert (result["done"], result["reward"], result["info"]["success"]) == (last, float(last), last)
    state = client.get(f"/instances/{instance_id}").json()
    assert (state["done"], state["total_reward"], state["turns"]) == (True, 1.0, len(actions))
    assert client.delete(f"/instances/{instance_id}").status_code == 204


def test_a_whole_plan_in_one_multi_action_turn(client: httpx.Client) -> None:
    created = create(client, 3, {"max_actions_per_turn": 64})
    actions = plan(created["observation"])
    response = client.post(f"/instances/{created['instance_id']}/step", json={"action": " || ".join(actions)})
    result = response.json()
    assert (result["done"], result["reward"]) == (True, 1.0), result
    assert result["info"] == {
        "valid": True,
        "success": True,
        "actions_executed": len(actions),
        "invalid_actions": 0,
    }


def test_concurrent_creates_with_one_seed_give_one_task(client: httpx.Client) -> None:
    seeds = [seed % 4 for seed in range(48)]
    expected = {seed: create(client, seed)["observation"] for seed in set(seeds)}
    with ThreadPoolExecutor(16) as pool:
        created = list(pool.map(lambda seed: create(client, seed), seeds))
    assert [c["observation"] for c in created] == [expected[seed] for seed in seeds]
    for instance in created:
        client.delete(f"/instances/{instance['instance_id']}")


def test_reset_replays_the_task_and_empties_the_inventory(client: httpx.Client) -> None:
    created = create(client, 9)
    instance_id = created["instance_id"]
    first = plan(created["observation"])[0]
    assert first.startswith("get ")
    client.post(f"/instances/{instance_id}/step", json={"action": first})
    reset = client.post(f"/instances/{instance_id}/reset", json={}).json()
    assert reset == {"observation": created["observation"], "info": created["info"]}
    inventory = client.post(f"/instances/{instance_id}/step", json={"action": "inventory"}).json()
    assert inventory["observation"] == "Inventory: You are not carrying anything."
    assert client.get(f"/instances/{instance_id}/available_actions").json() is None
    client.delete(f"/instances/{instance_id}")


def test_bad_options_are_422(client: httpx.Client) -> None:
    for options in [{"min_depth": 0}, {"min_depth": 3, "max_depth": 2}, {"depth": 2}]:
        response = client.post("/instances", json={"env": ENV, "seed": 0, "options": options})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "invalid_options"
