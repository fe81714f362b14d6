"""Start-up: seconds from ``stargym up`` to every service healthy, to the first update, and to all stopped.

``make demo``'s recipe through ``deploy.up.bring_up`` (Redis, the env server, the CPU engine, the
rollout worker, the trainer; private ports, the tiny model made beforehand), left as soon as the
trainer logged its first update. Each arm is a checkout, and what is measured is *its* launcher
and services (its ``deploy.up``, run in a process started in that checkout); runs alternate
between arms, so a machine that slows down slows them all alike. Time to learn
(``bench/learning.py``) counts from the same moment, so every second here is a second of it.

    python bench/startup.py --arm before=<worktree of an older commit> --arm main=. --runs 5

Prints the median of each arm and its ratio to the first arm's; writes ``bench/results/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.learning import arm, commit_of  # noqa: E402

RUN_DEADLINE_S = 300.0
"""A run that has not logged its first update by then has failed, and says so."""

PROBE = """
import json, sys, time
from pathlib import Path
from rich.console import Console
from deploy.launcher import free_port
from deploy.up import bring_up

run_dir, model, deadline_s = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
overrides = [f"run.output_dir={run_dir}", f"model.path={model}", f"dashboard.port={free_port()}",
             "run.name=bench-startup"]
started = time.monotonic()
with bring_up(Path("configs/frozenlake-tiny.yaml"), overrides, private=True,
              console=Console(stderr=True, quiet=True)) as stack:
    healthy = time.monotonic() - started
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if time.monotonic() - started > deadline_s:
            sys.exit(f"no update within {deadline_s:.0f} s; logs in {stack.log_dir}")
        time.sleep(0.05)
    first_update = time.monotonic() - started
    stopping = time.monotonic()
print(json.dumps({"healthy_s": healthy, "first_update_s": first_update, "stop_s": time.monotonic() - stopping}))
"""
"""Runs in the arm's checkout (``python -c`` puts the working directory first on ``sys.path``), with
no ``REDIS_URL``: each run starts a private Redis, as ``stargym up`` does on a machine without one."""

MEASURES = ("healthy_s", "first_update_s", "stop_s")


def run_once(tree: Path, model: Path, scratch: Path) -> dict[str, float]:
    """One start of the arm in ``tree``: its seconds to healthy, to the first update and to stopped."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(run_dir), str(model), str(RUN_DEADLINE_S)],
        cwd=tree,
        env={name: value for name, value in os.environ.items() if name != "REDIS_URL"},
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE_S + 120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: the start failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arm", type=arm, action="append", dest="arms", metavar="LABEL=DIR")
    parser.add_argument("--runs", type=int, default=5, help="Starts per arm.")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "startup.json")
    args = parser.parse_args()
    args.arms = args.arms or [("main", REPO_ROOT)]
    return args


def main() -> int:
    args = parse_args()
    from deploy.train import ensure_model, load_train_config

    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in args.arms}
    with tempfile.TemporaryDirectory(prefix="stargym-bench-startup-") as scratch:
        model = Path(scratch) / "model"  # the recipe's, made once: not part of any start
        ensure_model(load_train_config(REPO_ROOT / "configs/frozenlake-tiny.yaml", [f"model.path={model}"]))
        for index in range(args.runs):
            for label, tree in args.arms:
                seconds = run_once(tree, model, Path(scratch))
                runs[label].append(seconds)
                print(
                    f"run {index + 1}/{args.runs}, {label}: healthy after {seconds['healthy_s']:.1f} s, "
                    f"first update after {seconds['first_update_s']:.1f} s, stopped in {seconds['stop_s']:.1f} s"
                )
    medians = {
        label: {measure: statistics.median(run[measure] for run in mine) for measure in MEASURES}
        for label, mine in runs.items()
    }
    baseline = medians[args.arms[0][0]]
    print(f"\n| arm | healthy | first update | stopped | first update vs {args.arms[0][0]} |")
    print("|---|---|---|---|---|")
    for label, median in medians.items():
        ratio = baseline["first_update_s"] / median["first_update_s"]
        print(
            f"| {label} | {median['healthy_s']:.1f} s | {median['first_update_s']:.1f} s | "
            f"{median['stop_s']:.1f} s | {ratio:.2f}x |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                "arm_commits": {label: commit_of(tree) for label, tree in args.arms},
                "medians": medians,
                "runs": runs,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
