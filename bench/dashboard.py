"""Dashboard benchmark (``make bench``): page load at 10,000 steps, and what an open page costs training.

1. **Page load.** Two synthetic finished runs written by the trainer's own ``MetricsLogger`` with
   every key the charts plot (per-env keys included): 100 steps (the baseline) and 10,000 steps.
   Each is served by its own ``stargym dashboard``; headless Chromium (Debian's, driven by
   playwright) loads the charts page of each, alternating, and the time is from navigation start
   until every chart has drawn its points. The server downsamples each series to 1,000 points.
2. **Training with the page open.** A real run (``bring_up`` on ``configs/bandit-tiny.yaml``):
   updates alternate between phases with no page, with the charts page and the system page open
   in Chromium (each polls every 2 s), and with the same requests made over HTTP by a thread (the
   trainer's cost alone: on this 2-core machine Chromium drawing the charts competes for the
   cores, which a browser on the user's own machine would not); the mean ``system/update_s`` and
   ``system/step_time_s`` of each kind of phase are compared, and the trainer's own request
   counter shows the pages were polling.

Results go to ``bench/results/dashboard.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import free_port, start_server, stop_server, wait_until  # noqa: E402

from deploy.up import bring_up  # noqa: E402
from trainer.metrics import MetricsLogger, read_metrics  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dashboard.json"
CHROMIUM = "/usr/bin/chromium"
CHART_KEYS = [
    "eval/success", "rollout/success", "rollout/reward_mean", "eval/reward", "rollout/in_group_std",
    "train/entropy", "train/grad_norm", "train/kl", "train/clipfrac", "rollout/logprob_gap",
    "rollout/response_length", "rollout/turns", "rollout/staleness", "rollout/staleness_max",
    "rollout/kept_ratio", "system/tokens_per_s", "system/episodes_per_s", "system/update_s",
    "system/batch_wait_s", "system/step_time_s",
]  # fmt: skip
ENVS = ["game/frozenlake", "game/sokoban", "game/bandit"]


def synthetic_run(root: Path, steps: int) -> Path:
    """A finished run of ``steps`` updates with every charted key (and 9 per-env keys) each step."""
    run_dir = root / f"run-{steps}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"run:\n  name: run-{steps}\noptim:\n  total_steps: {steps}\n")
    logger = MetricsLogger(run_dir)
    for step in range(1, steps + 1):
        values = {key: math.sin(step / 50 + index) for index, key in enumerate(CHART_KEYS)}
        for env in ENVS:
            values |= {f"env/{env}/success": step / steps, f"env/{env}/reward": step / steps}
            values[f"env/{env}/turns"] = 3.0
        logger.log(step, values, timestamp=1.7e9 + step)
    logger.close()
    return run_dir


def charts_drawn_ms(page: object, url: str) -> float:
    """Milliseconds from navigation start until every chart on the charts page has points."""
    page.goto(f"{url}/#/charts")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => { const c = [...document.querySelectorAll('[data-chart]')];"
        " return c.length > 0 && c.every(e => Number(e.dataset.points || 0) > 0); }",
        timeout=30_000,
    )
    return float(page.evaluate("performance.now()"))  # type: ignore[attr-defined]


def bench_page_load(browser: object, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        for steps in (100, 10_000):
            root = Path(tmp) / str(steps)
            started = time.perf_counter()
            synthetic_run(root, steps)
            print(f"wrote {steps} steps in {time.perf_counter() - started:.1f} s")
            port = free_port()
            servers[steps] = start_server(
                ["dashboard", str(root), "--port", str(port)], port, Path(tmp) / "logs"
            )
        try:
            page = browser.new_page()  # type: ignore[attr-defined]
            times: dict[int, list[float]] = {100: [], 10_000: []}
            for server in servers.values():  # warm-up: first parse of the file, browser caches
                charts_drawn_ms(page, server.url)
            for _ in range(rounds):
                for steps, server in servers.items():
                    times[steps].append(charts_drawn_ms(page, server.url))
            page.close()
        finally:
            for server in servers.values():
                stop_server(server.process)
    small, large = statistics.median(times[100]), statistics.median(times[10_000])
    print(
        f"page load, charts drawn: 100 steps {small:.0f} ms, 10,000 steps {large:.0f} ms ({large / small:.2f}x)"
    )
    return {"load_ms_100_steps": small, "load_ms_10000_steps": large, "ratio": large / small}


def dashboard_requests(url: str) -> float:
    """Requests the trainer has answered on its dashboard routes (its own Prometheus counter)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("http_requests_total{") and ('route="/api' in line or 'route="/status"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Poller(threading.Thread):
    """What an open charts page and system page ask for every 2 s, without a browser: isolates the
    trainer's own cost of serving them from the browser's CPU on this shared 2-core machine."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            run = client.get("/api/runs").json()["live_run"]
            cursor = client.get(f"/api/runs/{run}/metrics", params={"keys": "*"}).json()["cursor"]
            while not self.done.wait(2.0):
                for path in ("/api/runs", "/status", "/api/system"):
                    client.get(path)
                cursor = client.get(f"/api/runs/{run}/metrics", params={"keys": "*", "after": cursor}).json()[
                    "cursor"
                ]


def bench_training(browser: object, rounds: int, steps_per_phase: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        overrides = [
            "run.name=bench-dashboard",
            f"run.output_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            f"dashboard.port={free_port()}",
            "optim.total_steps=100000",  # stopped once the phases are done
            "checkpoint.save_every=1000",
            "eval.every=0",
            "eval.episodes=8",
        ]
        kinds = ("closed", "open", "polled")
        phase_steps: dict[str, list[int]] = {kind: [] for kind in kinds}
        requests: dict[str, float] = dict.fromkeys(kinds, 0.0)
        with bring_up(ROOT / "configs/bandit-tiny.yaml", overrides) as stack:
            url = stack.trainer.url

            def step() -> int:
                status = stack.trainer_status() or {}
                return int(status.get("step", 0))

            wait_until(lambda: step() >= 2, "the first updates", deadline_s=300, interval_s=0.5)
            for _ in range(rounds):
                for kind in kinds:
                    pages: list[object] = []
                    poller = Poller(url) if kind == "polled" else None
                    if kind == "open":
                        for route in ("#/charts", "#/system"):
                            page = browser.new_page()  # type: ignore[attr-defined]
                            page.goto(f"{url}/{route}")
                            pages.append(page)
                    if poller is not None:
                        poller.start()
                    served = dashboard_requests(url)
                    first = step() + 1
                    wait_until(
                        lambda first=first: step() >= first + steps_per_phase,
                        f"{steps_per_phase} updates ({kind})",
                        deadline_s=600,
                        interval_s=0.5,
                    )
                    requests[kind] += dashboard_requests(url) - served
                    phase_steps[kind] += list(range(first + 1, first + steps_per_phase))  # whole updates only
                    for page in pages:
                        page.close()  # type: ignore[attr-defined]
                    if poller is not None:
                        poller.done.set()
                        poller.join(timeout=30)
            stack.trainer.process.terminate()
            stack.trainer.process.wait(timeout=120)
        records = {record["step"]: record for record in read_metrics(tmp_path / "run")}
    result: dict[str, float] = {}
    for key in ("system/update_s", "system/step_time_s"):
        name = key.split("/")[-1]
        for kind, steps in phase_steps.items():
            values = [records[s][key] for s in steps if s in records and records[s].get(key) is not None]
            result[f"{kind}_{name}"] = statistics.fmean(values)
        print(
            f"{key} over {len(phase_steps['closed'])} updates each: no page {result[f'closed_{name}']:.3f} s, "
            f"pages open in Chromium {result[f'open_{name}']:.3f} s ({result[f'open_{name}'] / result[f'closed_{name}']:.3f}x), "
            f"polled over HTTP {result[f'polled_{name}']:.3f} s ({result[f'polled_{name}'] / result[f'closed_{name}']:.3f}x)"
        )
    for kind in kinds:
        result[f"{kind}_dashboard_requests"] = requests[kind]
    print(
        "dashboard requests the trainer answered: " + ", ".join(f"{k} {v:.0f}" for k, v in requests.items())
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="Page loads of each run.")
    parser.add_argument("--rounds-training", type=int, default=2, help="Rounds of closed/open/polled phases.")
    parser.add_argument("--steps-per-phase", type=int, default=12)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        load = bench_page_load(browser, args.rounds)
        training = bench_training(browser, args.rounds_training, args.steps_per_phase)
        browser.close()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"machine": platform.platform(), "page_load": load, "training": training, "args": vars(args)},
            indent=2,
        )
        + "\n"
    )
    print(f"results in {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
