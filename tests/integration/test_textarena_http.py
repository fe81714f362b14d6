"""The textarena family over the native HTTP API: every game created, stepped with garbage and a legal
move, replayed by its seed; bad variants are 422."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import RunningServer, create_instance, start_family_server, step_instance, stop_server
from textarena_moves import FIRST_MOVES, GARBAGE, SEED

GAMES = sorted(FIRST_MOVES)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_family_server("textarena", tmp_path_factory)
    yield running
    stop_server(running.process)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    # RushHour's and Sokoban's resets take up to a second on a loaded 2-core machine.
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60.0)) as http:
        yield http


def create(client: httpx.Client, game: str, options: dict | None = None) -> dict:
    return create_instance(client, f"textarena/{game}", SEED, options)


step = step_instance


def test_every_game_is_served(client: httpx.Client) -> None:
    envs = client.get("/envs").json()["envs"]
    assert sorted(env["id"] for env in envs) == [f"textarena/{game}" for game in GAMES]
    hanoi = next(env for env in envs if env["id"] == "textarena/tower_of_hanoi")
    assert hanoi["options_schema"]["properties"]["variant"]["default"] == "TowerOfHanoi-v0"


@pytest.mark.parametrize("game", GAMES)
def test_garbage_then_a_legal_move(client: httpx.Client, game: str) -> None:
    created = create(client, game)
    instance_id = created["instance_id"]
    assert created["observation"] and created["info"]["history"].startswith("[GAME] ")
    garbage = step(client, instance_id, GARBAGE)
    assert (garbage["reward"], garbage["done"], garbage["info"]["valid"]) == (0.0, False, False)
    legal = step(client, instance_id, FIRST_MOVES[game])
    assert legal["info"]["valid"], legal
    assert created["observation"] not in legal["observation"]
    assert legal["info"]["history"].startswith(garbage["info"]["history"])
    again = create(client, game)  # the same seed, the same game
    assert again["observation"] == created["observation"]
    for instance in (instance_id, again["instance_id"]):
        assert client.delete(f"/instances/{instance}").status_code == 204


def test_a_variant_by_option_and_bad_ones_are_422(client: httpx.Client) -> None:
    hardcore = create(client, "guess_the_number", {"variant": "GuessTheNumber-v0-hardcore"})
    assert "between 1 and 50" in hardcore["observation"]
    client.delete(f"/instances/{hardcore['instance_id']}")
    for options in [{"variant": "GuessTheNumber-v0-raw"}, {"variant": "TowerOfHanoi-v0"}, {"size": 3}]:
        response = client.post(
            "/instances", json={"env": "textarena/guess_the_number", "seed": SEED, "options": options}
        )
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "invalid_options"


def test_a_textarena_crash_is_a_502_not_a_500(client: httpx.Client) -> None:
    # LightsOut's reset divides by zero for this seed (env.py); the server goes on serving.
    response = client.post("/instances", json={"env": "textarena/lights_out", "seed": 10067})
    assert response.status_code == 502, response.text
    assert "ZeroDivisionError" in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200
