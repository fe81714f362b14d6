"""The dashboard in real headless Chromium, during and after a real run (``bring_up`` on the bandit config).

During the run (the trainer's own dashboard): the pages load without console errors, a chart gains
points as updates complete, the system view shows the env server, the rollout worker, the engine
and Redis, and the trajectory viewer opens an episode whose token view has masked and unmasked
tokens. After it (``stargym dashboard RUNS_DIR`` with ``STARGYM_API_TOKEN``): nothing is readable
without the token, ``?token=`` signs the browser in, the live instance count equals the env
server's ``/instances``, a stopped engine turns red with its error, a trajectory (and an echo-trap
message) holding ``<script>alert(1)</script>`` renders as text, two runs overlay on one chart, a
chart exports as PNG and a trajectory as JSON, and ``../`` is refused. A screenshot of every page
goes to ``test-output/dashboard/``.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import httpx
import pytest
from conftest import (
    REPO_ROOT,
    RunningServer,
    free_port,
    short_run_overrides,
    start_server,
    stop_server,
    wait_until,
)
from dashboard_data import SCRIPT, make_run
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from deploy.up import bring_up

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(10 * 60)]

SCREENSHOTS = REPO_ROOT / "test-output" / "dashboard"
TOKEN = "dashboard-test-token"
PAGE_DEADLINE_MS = 20_000


@pytest.fixture(scope="module", autouse=True)
def screenshots() -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)


class Page:
    """A browser page that records console errors, uncaught exceptions and dialogs."""

    def __init__(self, browser: object, base_url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
        self.page = self.context.new_page()
        self.page.set_default_timeout(PAGE_DEADLINE_MS)
        self.base_url = base_url
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", self._dialog)

    def _dialog(self, dialog: object) -> None:
        self.dialogs.append(dialog.message)  # type: ignore[attr-defined]
        dialog.dismiss()  # type: ignore[attr-defined]

    def open(self, route: str) -> None:
        self.page.goto(f"{self.base_url}/{route}")
        self.page.wait_for_load_state("networkidle")

    def click_or_explain(self, selector: str) -> None:
        """Click the first match; when none shows up in time, fail with what the page said instead."""
        try:
            self.page.locator(selector).first.click()
        except PlaywrightTimeoutError:
            raise AssertionError(
                f"no {selector} within {PAGE_DEADLINE_MS} ms; the page said:\n{self.page.inner_text('body')}"
                f"\nconsole errors: {self.errors}"
            ) from None

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def points(self, chart: str) -> int:
        return int(self.page.get_attribute(f'[data-chart="{chart}"]', "data-points") or 0)

    def close(self) -> None:
        self.context.close()


def test_dashboard_live_and_finished(browser: object, tmp_path: Path, empty_redis_url: str) -> None:
    overrides = [
        *short_run_overrides(tmp_path, "dash"),
        f"dashboard.port={free_port()}",
        "optim.total_steps=100000",  # ended by SIGTERM below, once the live checks are done
        "checkpoint.save_every=20",
        "eval.every=0",
        "eval.episodes=16",
    ]
    with bring_up(
        REPO_ROOT / "configs/bandit-tiny.yaml", overrides, redis_url=empty_redis_url, private=True
    ) as stack:
        live = Page(browser, stack.trainer.url)
        live.open("#/charts")
        live.page.wait_for_selector('[data-chart="success"][data-points]')
        wait_until(lambda: live.points("success") > 0, "the success chart's first points", deadline_s=120)
        before = live.points("success")
        wait_until(
            lambda: live.points("success") > before,
            "the success chart to gain points without a reload",
            deadline_s=120,
            logs=[stack.trainer],
        )
        live.shot("charts-live")

        live.open("#/system")
        live.page.wait_for_selector(f'[data-engine="{stack.engine.url}"]')
        env_url = stack.env_urls["game"]
        live.page.wait_for_selector(f'[data-env-instances="{env_url}"]')
        assert stack.worker.url in live.page.locator("[data-worker]").first.inner_text()
        assert live.page.locator(".down").count() == 0, live.page.inner_text("body")
        live.shot("system-live")

        trainer = httpx.Client(base_url=stack.trainer.url, timeout=10.0)
        live_run = trainer.get("/api/runs").json()["live_run"]
        wait_until(
            lambda: trainer.get(f"/api/runs/{live_run}/trajectories").json()["total"],
            "the trainer's trajectory log to hold an episode",
            deadline_s=60,
            logs=[stack.trainer],
        )
        trainer.close()
        live.open("#/trajectories")
        live.click_or_explain("a[href^='#/trajectory/']")
        live.page.wait_for_selector("span.tok")
        assert live.page.locator('span.tok[data-mask="0"]').count() > 0
        assert live.page.locator('span.tok[data-mask="1"]').count() > 0
        live.shot("trajectory-live")
        assert live.errors == [], live.errors
        live.close()

        # The run is ended here, not by a step count: the bandit makes 40 updates in ~6 s, so a run
        # short enough to end on its own could end (and take its dashboard with it) mid-check.
        stack.trainer.stop(timeout_s=2 * 60)  # SIGTERM: the trainer saves a checkpoint and exits
        assert "run dash stopped at step" in stack.trainer.log(), stack.trainer.log()[-4000:]

        make_run(tmp_path, "xss", steps=5)
        port = free_port()
        server = start_server(
            [
                "dashboard",
                str(tmp_path),
                "--port",
                str(port),
                "--redis-url",
                empty_redis_url,
                "--run",
                "dash",
            ],
            port,
            tmp_path / "logs",
            env={"STARGYM_API_TOKEN": TOKEN},
            name="dashboard",
        )
        try:
            _check_finished(browser, server.url, env_url, stack.engine)
        finally:
            stop_server(server.process)


def _check_finished(browser: object, url: str, env_url: str, engine: RunningServer) -> None:
    for path in ("/api/runs", "/api/runs/run/metrics", "/api/system", "/static/vendor/plotly.min.js"):
        response = httpx.get(f"{url}{path}")
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "unauthorized"
    page_without = httpx.get(url, headers={"Accept": "text/html"})
    assert page_without.status_code == 401 and "<form" in page_without.text
    auth = {"Authorization": f"Bearer {TOKEN}"}
    connection = http.client.HTTPConnection(httpx.URL(url).host, httpx.URL(url).port, timeout=10.0)
    for path in ("/api/runs/../config", "/api/runs/%2e%2e/config", "/api/runs/..%2frun/config"):
        connection.request("GET", path, headers=auth)  # sent as written: httpx would resolve the ".."
        refused = connection.getresponse()
        assert refused.status == 404, (path, refused.read())
        refused.read()
    connection.close()

    env = httpx.Client(base_url=env_url, timeout=10.0)
    for seed in range(3):
        env.post("/instances", json={"env": "game/bandit", "seed": seed}).raise_for_status()
    expected = env.get("/instances").json()["count"]
    finished = Page(browser, url)
    finished.open(f"?token={TOKEN}#/system")
    assert "token=" not in finished.page.url  # redirected, the token is in the cookie
    counter = finished.page.locator(f'[data-env-instances="{env_url}"]')
    counter.wait_for()
    wait_until(
        lambda: counter.inner_text().strip() == str(expected), f"{expected} instances shown", deadline_s=20
    )
    finished.shot("system-finished")
    engine.stop()  # a dead service shows red, with its error
    dead = finished.page.locator(f'[data-engine="{engine.url}"].down')
    dead.wait_for()
    assert "connect" in dead.inner_text(), dead.inner_text()
    finished.shot("system-engine-down")

    finished.open("#/runs")
    finished.page.wait_for_selector('tr[data-run="xss"]')
    finished.shot("runs")
    finished.open("#/runs/run/config")
    assert "game/bandit" in finished.page.locator("pre[data-config-yaml]").inner_text()
    finished.shot("config")

    finished.open("#/trajectory/xss/g2-0")
    finished.page.wait_for_selector("span.tok")
    assert finished.page.get_by_text(SCRIPT, exact=False).count() > 0  # shown as text
    injected = "[...document.scripts].filter(s => s.textContent.includes('alert(1)')).length"
    assert finished.page.evaluate(injected) == 0
    assert finished.dialogs == []
    finished.shot("trajectory-script-inert")
    finished.open("#/group/xss/g2")
    finished.page.wait_for_selector("a[data-episode].status-filtered")
    assert finished.page.locator("a[data-episode].status-filtered").count() == 2
    assert finished.page.locator("[data-replies]").first.inner_text().strip() == "Dragon"
    finished.shot("group")
    finished.open("#/trajectory/xss/g1-1")
    finished.page.wait_for_selector("a[data-download-json]")
    with finished.page.expect_download() as download:
        finished.page.click("a[data-download-json]")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["job_id"] == "g1-1" and exported["tokens"]["advantages"] == [0, 0, 0, -0.5, -0.5]

    finished.open("#/charts?run=xss&run=run")  # two runs overlaid
    wait_until(lambda: finished.points("success") > 0, "the overlaid success chart", deadline_s=20)
    legend = finished.page.locator('[data-chart="success"]').inner_text()
    assert "xss" in legend and "run" in legend, legend
    echo = finished.page.locator('tr[data-echo-event="collapse"]')
    echo.wait_for()
    assert SCRIPT in echo.inner_text()
    with finished.page.expect_download() as png:
        finished.page.click('button[data-export-png="success"]')
    assert Path(png.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finished.shot("charts-finished")
    assert finished.errors == [], finished.errors
    finished.close()
    for instance in env.get("/instances").json()["instances"]:
        env.delete(f"/instances/{instance['instance_id']}")
    env.close()
