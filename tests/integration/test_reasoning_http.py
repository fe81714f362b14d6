"""The reasoning family over HTTP: reasoning-gym's questions and scores, its env list, its 422s.

One real ``stargym env serve reasoning`` (conftest's ``reasoning_server``), with other string
hashing than this process (``PYTHONHASHSEED``), so equal questions show they do not depend on it; questions and
gold answers come from reasoning-gym itself (:func:`reasoning_answers.reasoning_gym_item`).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import RunningServer, create_instance, step_instance
from reasoning_answers import reasoning_gym_item, reference_answer

from env_server.envs.reasoning.catalog import hosted_datasets
from env_server.envs.reasoning.hosted import ENV_CLASSES
from env_server.pool import parse_options

INFOS = {info.name: info for info in hosted_datasets()}
# A spread of kinds: arithmetic, puzzles with no single answer (rush_hour, graph_color), replies
# kept from code (spiral_matrix, countdown), the process-RNG users (list_functions, pool_matrix).
SAMPLE = [
    "basic_arithmetic",
    "countdown",
    "graph_color",
    "knights_knaves",
    "letter_counting",
    "list_functions",
    "maze",
    "pool_matrix",
    "rush_hour",
    "spiral_matrix",
    "word_ladder",
    "zebra_puzzles",
]
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def client(reasoning_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=reasoning_server.url, timeout=TIMEOUT) as http:
        yield http


def local_reward(name: str, seed: int, reply: str) -> float:
    env_class = ENV_CLASSES[f"reasoning/{name}"]
    env = env_class()
    env.reset(seed, parse_options(env_class, {})[0])
    return env.step(reply).reward


def create(client: httpx.Client, name: str, seed: int, options: dict | None = None) -> dict:
    return create_instance(client, f"reasoning/{name}", seed, options)


step = step_instance


@pytest.mark.parametrize("name", SAMPLE)
def test_the_gold_answer_scores_one_and_a_wrong_one_less(client: httpx.Client, name: str) -> None:
    seed = 42
    entry = reasoning_gym_item(name, seed)
    created = create(client, name, seed, {"max_attempts": 2})
    assert created["observation"] == entry["question"]
    assert created["info"] == {"dataset": name, "index": seed, "attempts_left": 2}
    wrong = step(client, created["instance_id"], "wrong")
    assert (wrong["done"], wrong["reward"], wrong["info"]["success"]) == (False, 0.0, False)
    assert wrong["info"]["score"] < 1.0 and wrong["observation"].startswith("Wrong (score ")
    right = step(client, created["instance_id"], f"<answer>{reference_answer(name, entry)}</answer>")
    assert (right["done"], right["reward"], right["info"]["success"]) == (True, 1.0, True)
    # the answer revealed is a right one here too (which one, of several, may follow the hashing)
    revealed = right["info"]["answer"]
    assert revealed == entry["answer"] or local_reward(name, seed, revealed) == 1.0
    state = client.get(f"/instances/{created['instance_id']}").json()
    assert (state["done"], state["total_reward"], state["turns"]) == (True, 1.0, 2)
    assert client.delete(f"/instances/{created['instance_id']}").status_code == 204


def test_the_same_seed_gives_the_same_question_under_concurrent_creates(client: httpx.Client) -> None:
    jobs = [(name, seed) for name in ("list_functions", "pool_matrix", "maze") for seed in range(4)] * 4
    with ThreadPoolExecutor(16) as pool:
        created = list(pool.map(lambda job: create(client, *job), jobs))
    for (name, seed), reply in zip(jobs, created, strict=True):
        assert reply["observation"] == reasoning_gym_item(name, seed)["question"], (name, seed)
        client.delete(f"/instances/{reply['instance_id']}")
    # a reset with a new seed asks that seed's question
    instance = create(client, "maze", 1)
    response = client.post(f"/instances/{instance['instance_id']}/reset", json={"seed": 9})
    assert response.json()["observation"] == reasoning_gym_item("maze", 9)["question"]


def test_every_dataset_asks_what_it_asks_in_this_process(client: httpx.Client) -> None:
    for env_id, env_class in ENV_CLASSES.items():
        here = env_class().reset(3, parse_options(env_class, {})[0]).observation
        created = create(client, env_class.name, 3)
        assert created["observation"] == here, env_id
        client.delete(f"/instances/{created['instance_id']}")


def test_envs_lists_every_hosted_dataset_with_its_config_schema(client: httpx.Client) -> None:
    specs = {spec["id"]: spec for spec in client.get("/envs").json()["envs"]}
    assert sorted(specs) == sorted(f"reasoning/{name}" for name in INFOS)
    for name, info in INFOS.items():
        spec = specs[f"reasoning/{name}"]
        assert (spec["name"], spec["family"], spec["reward_range"]) == (name, "reasoning", [0.0, 1.0])
        assert spec["instruction"].startswith(info.description)
        properties = spec["options_schema"]["properties"]
        assert {"config", "max_attempts", "max_actions_per_turn"} <= set(properties)
    schema = specs["reasoning/basic_arithmetic"]["options_schema"]
    config = schema["$defs"]["BasicArithmeticDatasetConfig"]
    assert config["additionalProperties"] is False
    assert config["properties"]["min_terms"]["default"] == 2
    assert config["properties"]["format_style"]["enum"] == ["simple", "natural"]
    assert schema["properties"]["max_attempts"]["maximum"] == 10


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "basic_arithmetic",
            {"config": {"min_terms": 4, "max_terms": 2}},
            "reasoning/basic_arithmetic: config: Value error, reasoning-gym refuses this config: "
            "max_terms must be >= min_terms",
        ),
        (
            "basic_arithmetic",
            {"config": {"min_terms": 2, "terms": 3}},
            "reasoning/basic_arithmetic: config.terms: Extra inputs are not permitted",
        ),
        (
            "rush_hour",
            {"config": {"min_moves": 200, "max_moves": 300}},
            "reasoning/rush_hour: reasoning-gym cannot build this config: "
            "No puzzles found with moves between 200 and 300",
        ),
    ],
)
def test_a_bad_config_is_422_with_a_clear_message(
    client: httpx.Client, name: str, options: dict, message: str
) -> None:
    response = client.post("/instances", json={"env": f"reasoning/{name}", "seed": 1, "options": options})
    assert response.status_code == 422, response.text
    assert response.json() == {"error": {"code": "invalid_options", "message": message}}
