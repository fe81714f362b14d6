"""web/shop in real headless Chromium: the pages of an agent's episode as a person sees them.

An oracle plays an episode through the env API; at every turn Chromium opens the page the agent
is on and checks that it renders without console errors, that the links and buttons it shows
are exactly the clickables the agent's observation lists (and a search bar where the agent may
search), and that every one of them works when clicked. The watch page follows a live session
as the agent acts. Screenshots go to ``test-output/web-shop/``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import REPO_ROOT, RunningServer, free_port, start_server, stop_server

from env_server.envs.web.catalog import Catalog, generate_catalog

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(10 * 60)]

SCREENSHOTS = REPO_ROOT / "test-output" / "web-shop"
PAGE_DEADLINE_MS = 20_000
CLICKABLE = "a, button"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp_path = tmp_path_factory.mktemp("web")
    port = free_port()
    running = start_server(
        ["env", "serve", "web", "--port", str(port)],
        port,
        tmp_path,
        env={"STARGYM_CACHE_DIR": str(tmp_path / "cache")},
        name="web",
    )
    yield running
    stop_server(running.process)


@pytest.fixture(scope="module", autouse=True)
def screenshots() -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return generate_catalog()


class Tab:
    """One browser page that records console errors and uncaught exceptions."""

    def __init__(self, browser: object, base_url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})  # type: ignore[attr-defined]
        self.page = self.context.new_page()
        self.page.set_default_timeout(PAGE_DEADLINE_MS)
        self.base_url = base_url
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, path: str) -> int:
        response = self.page.goto(f"{self.base_url}{path}")
        self.page.wait_for_load_state("load")
        return response.status if response else 0

    def clickables(self) -> list[str]:
        return self.page.eval_on_selector_all(CLICKABLE, "els => els.map(e => e.innerText.trim())")

    def close(self) -> None:
        self.context.close()


def clickables_of(http: httpx.Client, instance_id: str) -> dict:
    response = http.get(f"/agentgym/shop/available_actions?env_idx={instance_id}")
    assert response.status_code == 200
    return response.json()


def click_every_clickable(tab: Tab, url: str) -> int:
    """Click each link and button of the page at ``url`` (a fresh load each time); all must land on a page."""
    count = len(tab.clickables())
    for index in range(count):
        assert tab.open(url) == 200
        element = tab.page.locator(CLICKABLE).nth(index)
        label = element.inner_text().strip()
        if label == "Search":
            tab.page.fill("input[name=q]", "merino wool socks")
        with tab.page.expect_navigation() as navigation:
            element.click()
        landed = navigation.value
        assert landed is not None and landed.status == 200, (url, label)
        assert tab.page.locator("#instruction").count() == 1, (url, label)
    return count


def test_every_page_of_an_episode_renders_shows_what_the_agent_sees_and_every_link_works(
    server: RunningServer, browser: object, catalog: Catalog
) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        created = http.post(
            "/instances", json={"env": "web/shop", "seed": 3, "options": {"split": "test"}}
        ).json()
        instance_id = created["instance_id"]
        goal = catalog.goals["test"][created["info"]["index"]]
        product = catalog.products[goal.asin]
        plan = [
            f"search[{product.title}]",
            f"click[{goal.asin.lower()}]",
            "click[features]",
            "click[< prev]",
            *(f"click[{value}]" for value in goal.options.values()),
            "click[reviews]",
            "click[< prev]",
            "click[buy now]",
        ]
        tab = Tab(browser, server.url)
        shop = f"/shop/{instance_id}/"
        url, clicked = "start", 0
        try:
            for turn, action in enumerate(plan):
                seen = clickables_of(http, instance_id)
                assert tab.open(shop + url) == 200
                assert [label.lower() for label in tab.clickables()] == seen["clickables"], url
                assert (tab.page.locator("input[name=q]").count() == 1) == seen["has_search_bar"], url
                tab.page.screenshot(path=str(SCREENSHOTS / f"turn-{turn:02d}.png"), full_page=True)
                clicked += click_every_clickable(tab, shop + url)
                result = http.post(f"/instances/{instance_id}/step", json={"action": action}).json()
                assert result["info"]["valid"], (action, result["observation"])
                url = result["info"]["url"]
            assert result["done"] and result["reward"] == 1.0
            assert tab.open(shop + url) == 200 and tab.clickables() == []
            assert "1.0000" in tab.page.inner_text("body")
            tab.page.screenshot(path=str(SCREENSHOTS / "bought.png"), full_page=True)
            assert tab.errors == []
            print(f"\nweb/shop in Chromium: {len(plan) + 1} pages, {clicked} links and buttons clicked")
        finally:
            tab.close()


def test_the_watch_page_follows_the_agent_live(server: RunningServer, browser: object) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        created = http.post("/instances", json={"env": "web/shop", "seed": 8}).json()
        instance_id = created["instance_id"]
        tab = Tab(browser, server.url)
        try:
            assert tab.open(f"/shop/{instance_id}/") == 200
            frame = tab.page.locator("iframe#page")
            assert frame.get_attribute("src") == "start"
            step = http.post(
                f"/instances/{instance_id}/step", json={"action": "search[red lipstick vegan]"}
            ).json()
            tab.page.wait_for_function(
                "path => document.getElementById('page').getAttribute('src') === path",
                arg=step["info"]["url"],
            )
            tab.page.wait_for_function("() => document.querySelectorAll('#history li').length === 1")
            assert tab.page.inner_text("#history") == "search[red lipstick vegan]"
            inner = tab.page.frame_locator("iframe#page")
            assert "Total results" in inner.locator("body").inner_text()
            http.post(f"/instances/{instance_id}/step", json={"action": "click[nothing here]"})
            tab.page.wait_for_function("() => document.querySelectorAll('#history li.invalid').length === 1")
            tab.page.screenshot(path=str(SCREENSHOTS / "watch.png"), full_page=True)
            http.delete(f"/instances/{instance_id}")
            tab.page.wait_for_function(
                "() => document.getElementById('status').textContent.includes('ended')"
            )
            assert tab.errors == [] or all("404" in error for error in tab.errors)
        finally:
            tab.close()
