"""Time to learn: wall-clock minutes until the demo's policy reaches 0.5 held-out success.

What users judge a platform by on their own hardware: how fast reward goes up. Each run is
``make demo``'s recipe (``configs/frozenlake-tiny.yaml``, seed 0, from random weights) through the
real services (``deploy.up.bring_up``: Redis, env server, CPU engine, rollout worker, trainer),
with the trainer evaluating every ``--eval-every`` updates on the held-out seeds (sampled, as the
demo evaluates) while training goes on. A run's **time to learn** is the wall time from the
start of the services to the update whose policy first reached ``--target`` held-out success;
its **final success** is the newest policy's, played on the same seeds after the time budget.

Runs alternate between the engine paths (``--paths``): ``batched`` is today's engine,
``one-per-pass`` the engine before batched prefill (``STARGYM_PREFILL_TOKENS=0``: each prompt
prefilled alone), so both see the same machine in the same hour. The median of ``--runs`` runs
per path is reported (a run that never reached the target counts as its whole budget, and says
so). Results go to ``bench/results/learning.json`` and the plot of held-out success against
wall-clock minutes, one line per run, to ``bench/results/learning.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from deploy.demo import DEMO_CONFIG, train_and_evaluate  # noqa: E402
from trainer.metrics import read_metrics  # noqa: E402

PATHS = {"batched": None, "one-per-pass": "0"}
"""Engine path -> STARGYM_PREFILL_TOKENS (None: the engine's default)."""
TARGET_MINUTES = 4.0  # issue 15: half of the 7-9 minutes the demo took before


def run_once(path: str, index: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """One training run of ``args.minutes`` on ``path``; its eval curve and time to the target."""
    name = f"learning-{path}-{index}"
    overrides = [
        f"run.name={name}",
        f"run.output_dir={out_dir / name}",  # the run directory: one per run, or the next resumes it
        f"eval.every={args.eval_every}",
        f"eval.episodes={args.eval_episodes}",
        f"optim.total_steps={args.max_steps}",
        *args.set,
    ]
    previous = os.environ.get("STARGYM_PREFILL_TOKENS")
    if PATHS[path] is None:
        os.environ.pop("STARGYM_PREFILL_TOKENS", None)
    else:
        os.environ["STARGYM_PREFILL_TOKENS"] = PATHS[path]
    started = time.time()
    try:
        report = train_and_evaluate(
            DEMO_CONFIG,
            overrides,
            minutes=args.minutes,
            evaluate_before=False,
            trainer_threads=args.trainer_threads,
        )
    finally:
        if previous is None:
            os.environ.pop("STARGYM_PREFILL_TOKENS", None)
        else:
            os.environ["STARGYM_PREFILL_TOKENS"] = previous
    run_dir = report.config.run_dir
    step_minutes = {
        record["step"]: (record["time"] - started) / 60.0
        for record in read_metrics(run_dir)
        if "train/pg_loss" in record
    }
    curve = [
        {"step": record["step"], "minutes": step_minutes[record["step"]], "success": record["eval/success"]}
        for record in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())
        if record["step"] in step_minutes and "eval/success" in record
    ]
    reached = next((point for point in curve if point["success"] >= args.target), None)
    return {
        "path": path,
        "run": index,
        "minutes_to_target": reached["minutes"] if reached else None,
        "updates_to_target": reached["step"] if reached else None,
        "updates": report.steps,
        "train_minutes": report.train_minutes,
        "final_success": report.after.success,
        "final_invalid_rate": report.after.invalid_rate,
        "curve": curve,
    }


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per path: the median time and updates to the target (a miss counts as the whole budget)."""
    paths = {}
    for path in dict.fromkeys(run["path"] for run in runs):
        mine = [run for run in runs if run["path"] == path]
        minutes = [run["minutes_to_target"] or run["train_minutes"] for run in mine]
        updates = [run["updates_to_target"] or run["updates"] for run in mine]
        paths[path] = {
            "runs": len(mine),
            "reached_target": sum(run["minutes_to_target"] is not None for run in mine),
            "median_minutes_to_target": statistics.median(minutes),
            "median_updates_to_target": statistics.median(updates),
            "median_final_success": statistics.median(run["final_success"] for run in mine),
            "median_updates": statistics.median(run["updates"] for run in mine),
        }
    return paths


def plot(runs: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"batched": "tab:blue", "one-per-pass": "tab:orange"}
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        points = run["curve"]
        label = f"{run['path']}" if run["run"] == 0 else None
        axes.plot(
            [p["minutes"] for p in points],
            [p["success"] for p in points],
            color=colours.get(run["path"]),
            alpha=0.8,
            marker=".",
            label=label,
        )
    axes.axhline(args.target, color="grey", linestyle="--", linewidth=1)
    axes.axvline(TARGET_MINUTES, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("wall-clock minutes since the services started")
    axes.set_ylabel("held-out success (sampled)")
    axes.set_title(f"FrozenLake 4x4, tiny policy from random weights, {os.cpu_count()} CPU cores")
    axes.set_ylim(0, 1)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def render(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Time to {results['target']:.0%} held-out success ({results['machine']['cpus']} cores)"
    )
    for column in ("engine prefill", "runs reaching it", "median minutes", "median updates", "final success"):
        table.add_column(column, justify="right")
    for path, row in results["paths"].items():
        table.add_row(
            path,
            f"{row['reached_target']} / {row['runs']}",
            f"{row['median_minutes_to_target']:.1f}",
            f"{row['median_updates_to_target']:.0f}",
            f"{row['median_final_success']:.2f}",
        )
    Console(width=120).print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="Runs per engine path.")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["batched", "one-per-pass"])
    parser.add_argument("--minutes", type=float, default=9.0, help="Training budget per run (the demo's).")
    parser.add_argument("--max-steps", type=int, default=1000, help="Updates at most (the budget ends runs).")
    parser.add_argument("--eval-every", type=int, default=10, help="Updates between held-out evaluations.")
    parser.add_argument("--eval-episodes", type=int, default=256)
    parser.add_argument("--trainer-threads", type=int, default=1, help="The trainer's torch threads.")
    parser.add_argument("--target", type=float, default=0.5, help="Held-out success to reach.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for every run (as `stargym train --set`), e.g. rollout.groups_per_batch=8.",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "learning.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="stargym-bench-learning-") as tmp:
        for index in range(args.runs):
            for path in args.paths:
                print(
                    f"run {index + 1}/{args.runs}, engine prefill {path}: up to {args.minutes:g} minutes ..."
                )
                run = run_once(path, index, args, Path(tmp))
                reached = run["minutes_to_target"]
                outcome = (
                    f"reached {args.target:.2f} after {reached:.1f} min ({run['updates_to_target']} updates)"
                    if reached is not None
                    else f"did not reach {args.target:.2f}"
                )
                print(f"  {outcome}; final success {run['final_success']:.2f} after {run['updates']} updates")
                runs.append(run)
    import torch

    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "config": str(DEMO_CONFIG),
        "target": args.target,
        "minutes_per_run": args.minutes,
        "eval_every": args.eval_every,
        "eval_episodes": args.eval_episodes,
        "trainer_threads": args.trainer_threads,
        "overrides": args.set,
        "runtime_s": time.perf_counter() - started,
        "paths": summarise(runs, args),
        "runs": runs,
    }
    render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(runs, args, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
