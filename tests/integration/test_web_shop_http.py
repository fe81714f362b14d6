"""web/shop over HTTP: the oracle and a random agent, the shop's pages, bad input, AgentGym's client,
and WebShop's own product files (``--catalog``, ``--attributes``).

One server for the module with a cache folder of its own (its start generates the catalog and
builds the search index: timed and printed). The test process generates the same catalog to
know each goal's product, as the oracle is told it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RunningServer, free_port, start_server, stop_server
from shop_agents import oracle, random_agent

from env_server.envs.web.catalog import Catalog, generate_catalog

ENV = "web/shop"
TIMEOUT = httpx.Timeout(60.0)
ORACLE_SAMPLE = 10
RANDOM_SAMPLE = 30


def serve(tmp_path: Path, *extra: str) -> RunningServer:
    port = free_port()
    return start_server(
        ["env", "serve", "web", "--port", str(port), *extra],
        port,
        tmp_path,
        env={"STARGYM_CACHE_DIR": str(tmp_path / "cache")},
        name="web",
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = serve(tmp_path_factory.mktemp("web"))
    yield running
    stop_server(running.process)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return generate_catalog()


def create(client: httpx.Client, seed: int, **options: object) -> dict:
    response = client.post("/instances", json={"env": ENV, "seed": seed, "options": options})
    assert response.status_code == 201, response.text
    return response.json()


class Remote:
    """One instance driven through the native API, as the agents' step and actions functions."""

    def __init__(self, client: httpx.Client, instance_id: str) -> None:
        self.client, self.id = client, instance_id

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        response = self.client.post(f"/instances/{self.id}/step", json={"action": action})
        assert response.status_code == 200, response.text
        body = response.json()
        return body["observation"], body["reward"], body["done"], body["info"]

    def actions(self) -> list[str] | None:
        return self.client.get(f"/instances/{self.id}/available_actions").json()


def test_the_oracle_buys_every_target_with_reward_1(client: httpx.Client, catalog: Catalog) -> None:
    for seed in range(ORACLE_SAMPLE):
        created = create(client, seed, split="test")
        goal = catalog.goals["test"][created["info"]["index"]]
        assert created["info"]["asin"] == goal.asin and goal.instruction in created["observation"]
        remote = Remote(client, created["instance_id"])
        outcome = oracle(catalog.products[goal.asin], goal, remote.step, remote.actions)
        assert outcome.success and outcome.reward == 1.0, outcome.actions
        client.delete(f"/instances/{created['instance_id']}")


def test_a_random_agent_scores_low(client: httpx.Client) -> None:
    rng = random.Random(1)
    rewards, successes = [], 0
    for seed in range(RANDOM_SAMPLE):
        created = create(client, 1000 + seed, split="test")
        instruction = created["observation"].split(" [SEP] ")[2]
        remote = Remote(client, created["instance_id"])
        outcome = random_agent(instruction, remote.step, remote.actions, rng)
        rewards.append(outcome.reward)
        successes += outcome.success
        client.delete(f"/instances/{created['instance_id']}")
    mean = sum(rewards) / len(rewards)
    print(
        f"\nweb/shop over HTTP, random agent on {RANDOM_SAMPLE} test goals: mean reward {mean:.3f}, "
        f"success {successes / RANDOM_SAMPLE:.3f}"
    )
    assert mean < 0.35 and successes <= 2


def test_every_page_of_an_episode_is_served_and_the_watch_page_follows(
    client: httpx.Client, catalog: Catalog
) -> None:
    created = create(client, 5, split="dev")
    shop = f"/shop/{created['instance_id']}/"
    watch = client.get(shop)
    assert watch.status_code == 200 and watch.headers["content-type"].startswith("text/html")
    assert f'<base href="{shop}">' in watch.text and 'src="start"' in watch.text
    goal = catalog.goals["dev"][created["info"]["index"]]
    remote = Remote(client, created["instance_id"])
    outcome = oracle(catalog.products[goal.asin], goal, remote.step, remote.actions)
    assert outcome.success
    live = client.get(f"{shop}live").json()
    assert live["done"] and live["reward"] == 1.0 and live["turns"] == len(outcome.actions)
    assert [entry["action"] for entry in live["history"]] == outcome.actions and live["path"] == outcome.urls[
        -1
    ]
    for url in ["start", *outcome.urls]:
        page = client.get(shop + url)
        assert page.status_code == 200, (url, page.text)
        assert f'<base href="{shop}">' in page.text and goal.instruction in page.text
    assert "1.0000" in client.get(shop + outcome.urls[-1]).text  # the purchase page shows the score


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/shop/00000000-0000-0000-0000-000000000000/", 404),
        ("{shop}item/NOPE", 404),
        ("{shop}checkout", 404),
        ("{shop}item/{asin}/manual", 404),
        ("{shop}item/{asin}?o.color=plaid-ish", 422),
        ("{shop}search?q=socks&page=-1", 422),
    ],
)
def test_pages_that_do_not_exist_get_the_error_contract(
    client: httpx.Client, catalog: Catalog, path: str, status: int
) -> None:
    created = create(client, 6)
    url = path.format(shop=f"/shop/{created['instance_id']}/", asin=created["info"]["asin"])
    response = client.get(url)
    assert response.status_code == status and response.json()["error"]["message"]
    client.delete(f"/instances/{created['instance_id']}")
    assert client.get(f"/shop/{created['instance_id']}/start").status_code == 404  # closed: gone


def test_bad_options_and_actions_get_the_error_contract_or_an_observation(client: httpx.Client) -> None:
    for options, fragment in [
        ({"split": "holdout"}, "split"),
        ({"index": 10**6}, "past the"),
        ({"start": "checkout"}, "start"),
        ({"colour": "red"}, "colour"),
    ]:
        response = client.post("/instances", json={"env": ENV, "seed": 1, "options": options})
        assert response.status_code == 422 and fragment in response.text, response.text
    created = create(client, 7)
    step = Remote(client, created["instance_id"]).step
    observation, _, done, info = step("search[" + "x" * 100_000 + "]")
    assert info["valid"] and info["query_truncated"] and not done and "Total results" in observation
    observation, _, _, info = step("click[B0NOTREAL]")
    assert not info["valid"] and "is not a clickable on this page" in observation
    observation, _, _, info = step("click[")
    assert not info["valid"] and "an action is search[keywords] or click[value]" in observation
    for action in ("click[back to search]", "search[wool socks]", "click[next >]"):
        assert step(action)[3]["valid"]
    product = Remote(client, created["instance_id"]).actions()[3]
    step(product)
    assert step("click[buy now]")[2]
    late = client.post(f"/instances/{created['instance_id']}/step", json={"action": "click[buy now]"})
    assert late.status_code == 409 and late.json()["error"]["code"]


def test_agentgyms_webshop_client_requests_work_unmodified(client: httpx.Client, catalog: Catalog) -> None:
    """Exactly what ``agentenv.envs.WebshopEnvClient`` sends: /create with no body, then env_idx."""
    base = "/agentgym/shop"
    created = client.post(f"{base}/create")
    assert created.status_code == 200
    env_idx = created.json()
    assert isinstance(env_idx, str)
    reset = client.post(f"{base}/reset", json={"session_id": 2, "env_idx": env_idx})
    assert reset.status_code == 200 and reset.json()[1] is None
    observation = client.get(f"{base}/observation?env_idx={env_idx}").json()
    goal = catalog.goals["test"][2]  # AgentGym's session ids start with the test goals
    assert observation == reset.json()[0] and observation.startswith("WebShop [SEP] Instruction: [SEP] ")
    assert goal.instruction in observation
    actions = client.get(f"{base}/available_actions?env_idx={env_idx}").json()
    assert actions == {"has_search_bar": True, "clickables": ["search"]}
    instruction = client.get(f"{base}/instruction_text?env_idx={env_idx}").json()
    assert instruction == f"Instruction: {goal.instruction}"
    product = catalog.products[goal.asin]
    state = client.post(
        f"{base}/step", json={"action": f"search[{product.title}]", "env_idx": env_idx}
    ).json()
    assert set(state) == {"state", "reward", "done", "info"} and state["info"] is None and not state["done"]
    clickables = client.get(f"{base}/available_actions?env_idx={env_idx}").json()["clickables"]
    assert clickables[:2] == ["back to search", "next >"] and goal.asin.lower() in clickables
    actions_taken = [
        f"click[{goal.asin.lower()}]",
        *(f"click[{v}]" for v in goal.options.values()),
        "click[buy now]",
    ]
    for action in actions_taken:
        state = client.post(f"{base}/step", json={"action": action, "env_idx": env_idx}).json()
    assert state["done"] and state["reward"] == 1.0
    page = client.get(f"{base}/state?env_idx={env_idx}").json()
    assert page["url"].startswith(f"buy/{goal.asin}") and "Thank you for shopping with us!" in page["html"]
    assert page["instruction_text"] == instruction
    again = client.post(f"{base}/reset", json={"env_idx": env_idx})  # no session: the instance's own goal
    assert again.status_code == 200 and "WebShop [SEP]" in again.json()[0]
    assert client.post(f"{base}/close", json={"env_idx": env_idx}).json() == {"closed": True}
    assert client.get(f"{base}/observation?env_idx={env_idx}").status_code == 404
    past = client.post(f"{base}/create").json()
    too_far = client.post(f"{base}/reset", json={"env_idx": past, "session_id": 10**7})
    assert too_far.status_code == 422 and "past the" in too_far.text


def webshop_files(catalog: Catalog, folder: Path, count: int) -> tuple[Path, Path]:
    """``count`` of our products written the way WebShop's setup downloads its data."""
    items, extra = [], {}
    for product in list(catalog.products.values())[:count]:
        items.append(
            {
                "asin": product.asin,
                "name": product.title,
                "query": product.query,
                "category": product.category,
                "product_category": product.product_category,
                "full_description": product.description,
                "pricing": f"${product.price:.2f}",
                "small_description": list(product.features),
                "customization_options": {
                    n: [{"value": v, "image": None} for v in vs] for n, vs in product.options.items()
                },
                "average_rating": product.rating,
            }
        )
        extra[product.asin] = {
            "attributes": list(product.attributes),
            "instruction": f"i want a {product.query} that is {product.attributes[0]}",
            "instruction_attributes": [product.attributes[0]],
            "instruction_options": [],
        }
    items_path, attributes_path = folder / "items_shuffle.json", folder / "items_ins_v2.json"
    items_path.write_text(json.dumps(items))
    attributes_path.write_text(json.dumps(extra))
    return items_path, attributes_path


def test_webshops_own_files_are_served_with_catalog(tmp_path: Path, catalog: Catalog) -> None:
    items, attributes = webshop_files(catalog, tmp_path, 200)
    running = serve(tmp_path, "--catalog", str(items), "--attributes", str(attributes))
    try:
        with httpx.Client(base_url=running.url, timeout=TIMEOUT) as http:
            created = create(http, 0, split="train")
            asin = created["info"]["asin"]
            first_200 = list(catalog.products)[:200]
            assert asin in first_200 and "i want a" in created["observation"]
            remote = Remote(http, created["instance_id"])
            product = catalog.products[asin]
            observation, *_ = remote.step(f"search[{product.title}]")
            assert "(Total results: 50)" in observation
            assert set(a[6:-1].upper() for a in remote.actions() or [] if a.startswith("click[b0")) <= set(
                first_200
            )
    finally:
        stop_server(running.process)


def test_a_bad_catalog_file_stops_the_server_naming_it(tmp_path: Path) -> None:
    items, attributes = tmp_path / "items_shuffle.json", tmp_path / "items_ins_v2.json"
    items.write_text('[{"asin": "B01", "name": "x"}')  # cut short
    attributes.write_text("{}")
    command = [sys.executable, "-m", "deploy", "env", "serve", "web", "--port", str(free_port())]
    done = subprocess.run(
        [*command, "--catalog", str(items), "--attributes", str(attributes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and f"cannot serve {ENV}: {items}: not JSON" in done.stderr
    only_one = subprocess.run(
        [*command, "--catalog", str(items)], capture_output=True, text=True, timeout=120
    )
    assert only_one.returncode == 2 and "catalog is set but attributes is not" in only_one.stderr
