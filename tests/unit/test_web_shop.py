"""web/shop in-process: the generated catalog, WebShop's reward, the pages and their text, the env."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from shop_agents import oracle, random_agent

from env_server.envs.search.retriever import Retriever
from env_server.envs.web.catalog import (
    PRODUCTS_PER_TYPE,
    Goal,
    Product,
    generate_catalog,
    parse_price,
    product_passages,
)
from env_server.envs.web.catalog_tables import PRODUCT_TYPES
from env_server.envs.web.reward import purchase_score, type_reward
from env_server.envs.web.shop import ShopData, ShopEnv, ShopOptions
from env_server.envs.web.site import START, Page, follow, page_at, read_page
from services.errors import ApiError


@pytest.fixture(scope="module")
def shop() -> ShopData:
    catalog = generate_catalog()
    return ShopData(catalog, Retriever(product_passages(catalog.products.values())))


def new_env(shop: ShopData, seed: int, **options: object) -> ShopEnv:
    env = ShopEnv(shop)
    env.reset(seed, ShopOptions(**options))
    return env


def play(env: ShopEnv):
    def step(action: str):
        result = env.step(action)
        return result.observation, result.reward, result.done, result.info

    return step


def test_the_catalog_is_big_varied_and_the_same_in_every_process(shop: ShopData) -> None:
    products = shop.catalog.products
    assert len(products) == len(PRODUCT_TYPES) * PRODUCTS_PER_TYPE >= 10_000
    assert len({p.title for p in products.values()}) > 0.95 * len(products)
    assert {p.category for p in products.values()} == {
        "beauty",
        "grocery",
        "fashion",
        "furniture",
        "electronics",
    }
    for product in list(products.values())[::97]:
        assert product.options and all(len(values) >= 2 for values in product.options.values())
        assert 3 <= len(product.attributes) <= 5 and product.features and product.description
    # another interpreter (another hash seed) generates the same catalog and goals
    code = (
        "from env_server.envs.web.catalog import generate_catalog; c = generate_catalog(); "
        "print(list(c.products)[:3], list(c.products)[-1], c.goals['test'][7].instruction)"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout
        for seed in ("1", "2")
    }
    here = generate_catalog()
    assert outputs == {
        f"{list(here.products)[:3]} {list(here.products)[-1]} {here.goals['test'][7].instruction}\n"
    }


def test_goal_splits_are_disjoint_by_product_and_read_like_webshop(shop: ShopData) -> None:
    goals = shop.catalog.goals
    sizes = {name: len(split) for name, split in goals.items()}
    assert sizes["train"] > 8 * sizes["test"] / 1.3 and sizes["dev"] > 800 and sizes["test"] > 800
    asins = {name: {goal.asin for goal in split} for name, split in goals.items()}
    assert (
        not asins["train"] & asins["test"]
        and not asins["train"] & asins["dev"]
        and not asins["dev"] & asins["test"]
    )
    # consecutive seeds pick goals of every type, not of the catalog's first few
    assert len({shop.catalog.products[g.asin].query for g in goals["dev"][:200]}) == len(PRODUCT_TYPES)
    goal = goals["test"][0]
    product = shop.catalog.products[goal.asin]
    assert goal.instruction.endswith(f"and price lower than {goal.price_upper:.2f} dollars")
    assert product.query in goal.instruction and all(
        value in goal.instruction for value in goal.options.values()
    )
    assert goal.price_upper > product.price and goal.price_upper % 10 == 0


def test_the_reward_is_webshops_formula(shop: ShopData) -> None:
    goal = shop.catalog.goals["test"][3]
    product = shop.catalog.products[goal.asin]
    assert purchase_score(product, goal.options, product.price, goal).reward == 1.0
    # no option chosen: (attributes + 0 + price) / (attributes + options + 1)
    n_att, n_opt = len(goal.attributes), len(goal.options)
    assert purchase_score(product, {}, product.price, goal).reward == pytest.approx(
        (n_att + 1) / (n_att + n_opt + 1)
    )
    over = purchase_score(product, goal.options, goal.price_upper + 1, goal)
    assert not over.price_ok and over.reward == pytest.approx((n_att + n_opt) / (n_att + n_opt + 1))
    other_type = next(p for p in shop.catalog.products.values() if type_reward(p, goal)[1] == 0.0)
    assert other_type.category != product.category or other_type.query != product.query
    assert purchase_score(other_type, goal.options, 1.0, goal).reward == 0.0  # r_type 0: nothing in common
    half = Goal(
        **{**goal.model_dump(), "query": "x", "product_category": "A › B"}
    )  # only half the nouns match
    shared = Product(**{**product.model_dump(), "title": "Thing", "type_nouns": (*goal.type_nouns[:1], "zz")})
    score = purchase_score(shared, goal.options, product.price, half)
    expected = 1.0 if 1 / len(goal.type_nouns) > 0.2 else 0.5
    assert score.r_type == expected


def test_prices_of_webshop_files_parse() -> None:
    assert parse_price("$12.99") == 12.99
    assert parse_price("$10.99 - $1,020.50") == 10.99
    assert parse_price(7) == 7.0 and parse_price(None) == 0.0 and parse_price(["$3.50", "$2.25"]) == 2.25


def test_page_urls_round_trip_and_bad_ones_are_404_or_422(shop: ShopData) -> None:
    products = shop.catalog.products
    product = next(iter(products.values()))
    name, values = next(iter(product.options.items()))
    pages = [
        START,
        Page("results", query="red & blue / 100%", page=3),
        Page("item", query="q", page=2, asin=product.asin, options=((name, values[1]),)),
        Page("section", query="q", asin=product.asin, section="reviews"),
        Page("done", query="q", asin=product.asin, options=((name, values[0]),)),
    ]
    for page in pages:
        assert follow(page.path(), products) == page
    for path, params, status in [
        ("item/NOPE", {}, 404),
        (f"item/{product.asin}/manual", {}, 404),
        ("checkout", {}, 404),
        (f"item/{product.asin}", {f"o.{name}": "not a value"}, 422),
        ("search", {"q": "x", "page": "0"}, 422),
        ("search", {"q": "x", "page": "two"}, 422),
    ]:
        with pytest.raises(ApiError) as caught:
            page_at(path, params, products)
        assert caught.value.status == status, path


def test_the_observation_is_the_text_of_the_html_and_clickables_are_its_links(shop: ShopData) -> None:
    env = new_env(shop, 11)
    assert env.text.observation.startswith("WebShop [SEP] Instruction: [SEP] ")
    assert env.text.observation.endswith(" [SEP] Search") and env.available_actions() is None
    env.step("search[wool socks merino]")
    text = read_page(env.html)
    assert text.observation == env.text.observation and "Page 1 (Total results: 50)" in text.observation
    labels = [label for label, _ in text.clickables]
    assert labels[:2] == ["Back to Search", "Next >"] and len(labels) == 12
    assert env.available_actions() == [f"click[{label.lower()}]" for label in labels]
    html = env.render(env.page, "/shop/x/")
    assert '<base href="/shop/x/">' in html and "<script" not in html


def test_the_oracle_buys_the_target_with_reward_1(shop: ShopData) -> None:
    rewards = []
    for seed in range(12):
        env = new_env(shop, seed, split="test")
        assert env.goal is not None
        outcome = oracle(shop.catalog.products[env.goal.asin], env.goal, play(env), env.available_actions)
        rewards.append(outcome.reward)
        assert outcome.done and outcome.success, outcome.actions
    assert rewards == [1.0] * 12


def test_a_random_agent_scores_low(shop: ShopData) -> None:
    rng = random.Random(0)
    outcomes = []
    for seed in range(60):
        env = new_env(shop, seed, split="test")
        assert env.goal is not None
        outcomes.append(random_agent(env.goal.instruction, play(env), env.available_actions, rng))
    mean = sum(o.reward for o in outcomes) / len(outcomes)
    success = sum(o.success for o in outcomes) / len(outcomes)
    print(
        f"\nweb/shop random agent, 60 test goals: mean reward {mean:.3f}, success {success:.3f}, "
        f"bought in {sum(o.done for o in outcomes)} episodes"
    )
    assert mean < 0.35 and success < 0.1


def test_invalid_actions_say_what_is_wrong_and_keep_the_page(shop: ShopData) -> None:
    env = new_env(shop, 4)
    cases = {
        "buy it": "an action is search[keywords] or click[value]",
        "click[buy now]": "is not a clickable on this page",
        "click[search]": "type the search into the search bar",
        "search[!!! ???]": "no words to search for",
        "search[\x00\x01\x7f]": "no words to search for",
    }
    for action, message in cases.items():
        before = env.text.observation
        step = env.step(action)
        assert step.info["valid"] is False and message in step.observation and not step.done
        assert step.observation.endswith(before) and env.text.observation == before
    huge = env.step("search[" + "socks " * 20_000 + "]")
    assert huge.info["valid"] and huge.info["query_truncated"] and "Total results" in huge.observation
    assert env.step("search[socks]").info["valid"] is False  # no search bar on a results page
    assert Counter(valid for _, valid in env.history) == {False: 6, True: 1}


def test_start_on_results_skips_the_search(shop: ShopData) -> None:
    env = new_env(shop, 2, start="results")
    assert env.page.kind == "results" and env.available_actions()
    assert env.goal is not None and env.page.query == env.goal.instruction


def test_bad_web_settings_are_an_env_failure_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from env_server.core import EnvFailure
    from env_server.envs.web import shop as shop_module

    monkeypatch.setattr(shop_module.SHARED, "_value", None)
    monkeypatch.setenv("STARGYM_WEB_CATALOG", str(tmp_path / "items_shuffle.json"))
    with pytest.raises(EnvFailure, match="web settings: catalog: Path does not point to a file"):
        ShopEnv().reset(0, ShopOptions())
    (tmp_path / "items_shuffle.json").write_text("[]")
    (tmp_path / "items_ins_v2.json").write_text("{}")
    monkeypatch.setenv("STARGYM_WEB_ATTRIBUTES", str(tmp_path / "items_ins_v2.json"))
    with pytest.raises(EnvFailure, match="no product with an asin and a name"):
        ShopEnv().reset(0, ShopOptions())
