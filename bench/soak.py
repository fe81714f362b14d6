"""``make soak``: the demo's run under ``stargym up`` for 30 minutes; fails if a service keeps growing.

Brings up the whole system of ``configs/frozenlake-tiny.yaml`` (a private Redis, the game env
server, the CPU engine, a rollout worker, the trainer) with an update budget it cannot reach, so
it trains for the whole time, and reads every process's RSS (``VmRSS``, its children's added)
every ``--interval-s``. The warm-up ends after ``--warmup-minutes`` and ``WARMUP_UPDATES`` updates,
whichever is later (caches, the allocator's pools, the optimizer's state and torch's workspaces
fill up; on a busy machine the updates come slower than the minutes); the RSS of the last minute of the warm-up is each service's baseline; the
RSS of the last minute of the run must stay within 10% of it. Exit 1 names the services that grew
more, or a service that died. Redis is shown but not judged: it holds the run's data, which grows
by design until its bounds (a ``done:<job_id>`` key per job for ``DEFAULT_DEDUP_TTL_S``, pending
trajectories until the next checkpoint acks them). Results go to ``bench/results/soak.json``.

    .venv/bin/python bench/soak.py [--minutes 30] [--warmup-minutes 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from deploy.up import bring_up  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "frozenlake-tiny.yaml"
GROWTH_LIMIT = 0.10
WINDOW_S = 60.0  # the baseline and the end are each the median of this last stretch
WARMUP_UPDATES = 20


def rss_kib(pid: int) -> int:
    """``pid``'s RSS plus its descendants' (a JVM, a sandboxed instance), in KiB; 0 once gone."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def window(samples: list[tuple[float, int]], end_s: float) -> int:
    """The median RSS of the samples in the minute before ``end_s``."""
    values = [rss for at, rss in samples if end_s - WINDOW_S <= at <= end_s]
    return int(statistics.median(values)) if values else 0


def main(minutes: float, warmup_minutes: float, interval_s: float) -> int:
    if warmup_minutes + WINDOW_S / 60 >= minutes:
        raise SystemExit("--minutes must leave more than a minute after the warm-up")
    os.environ.pop("REDIS_URL", None)  # a private Redis: its memory is this run's alone
    run_dir = Path(tempfile.mkdtemp(prefix="stargym-soak-"))
    overrides = [f"run.output_dir={run_dir}", "run.name=soak", "optim.total_steps=1000000"]
    samples: dict[str, list[tuple[float, int]]] = {}
    died: list[str] = []
    with bring_up(CONFIG, overrides, trainer_args=["--max-minutes", str(minutes + 2)], private=True) as stack:
        pids = {service.name: service.process.pid for service in stack.services}
        if stack.redis.process is not None:
            pids["redis"] = stack.redis.process.pid
        started = time.monotonic()
        warm_end: float | None = None
        while (elapsed := time.monotonic() - started) < minutes * 60:
            if warm_end is None and elapsed >= warmup_minutes * 60:
                status = stack.trainer_status()
                if status is not None and status["step"] >= WARMUP_UPDATES:
                    warm_end = elapsed
            for name, pid in pids.items():
                rss = rss_kib(pid)
                if rss == 0 and name not in died:
                    died.append(name)
                samples.setdefault(name, []).append((elapsed, rss))
            if died:
                break
            time.sleep(interval_s)
        status = stack.trainer_status()
    if warm_end is None or elapsed - warm_end < WINDOW_S:
        print(f"FAILED: the run never warmed up ({WARMUP_UPDATES} updates and a minute of run after them)")
        return 1
    run_end = min(elapsed, minutes * 60)
    rows = []
    for name, series in samples.items():
        baseline, end = window(series, warm_end), window(series, run_end)
        growth = end / baseline - 1 if baseline else float("inf")
        rows.append(
            {"service": name, "baseline_mib": baseline / 1024, "end_mib": end / 1024, "growth": growth}
        )
    print(
        f"\nRSS of every service (children included), {minutes:g} min of training, {warmup_minutes:g} min warm-up"
    )
    print("| service | after warm-up MiB | at the end MiB | growth |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['service']} | {row['baseline_mib']:.0f} | {row['end_mib']:.0f} | {row['growth']:+.1%} |"
        )
    if status is not None:
        print(f"\ntrainer at the end: update {status.get('step')}, {status.get('state', '')}")
    out = REPO_ROOT / "bench" / "results" / "soak.json"
    out.write_text(
        json.dumps({"minutes": minutes, "warmup_minutes": warmup_minutes, "rows": rows}, indent=2) + "\n"
    )
    grown = [row["service"] for row in rows if row["growth"] > GROWTH_LIMIT and row["service"] != "redis"]
    if died:
        print(f"FAILED: {', '.join(died)} exited during the soak; logs in {stack.log_dir}")
    if grown:
        print(f"FAILED: RSS grew more than {GROWTH_LIMIT:.0%} after the warm-up: {', '.join(grown)}")
    return 1 if died or grown else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=5.0)
    parser.add_argument("--interval-s", type=float, default=10.0)
    args = parser.parse_args()
    raise SystemExit(main(args.minutes, args.warmup_minutes, args.interval_s))
