"""Time to learn: wall-clock minutes until the demo's policy reaches 0.5 held-out success.

What users judge a platform by on their own hardware: how fast reward goes up. Each run is
``make demo``'s recipe (``configs/frozenlake-tiny.yaml``, seed 0, from random weights) through the
real services (``deploy.up.bring_up``: Redis, env server, CPU engine, rollout worker, trainer),
trained for ``--minutes`` exactly as the demo trains: nothing else runs meanwhile. The trainer
keeps every published policy, and afterwards every ``--eval-every``-th one plays the held-out
seeds (sampled, as the demo evaluates; ``stargym eval`` machinery, services of its own). A
run's **time to learn** is the wall time from the start of the services to the publication of the
first policy that reached ``--target``; its **final success** is the newest policy's. Evaluating
during training instead would slow what it measures: a round of 256 held-out episodes queued
every 10 updates delayed the next batch by 3-4 s, a third of the time of 10 one-turn updates.

An **arm** is a checkout (``--arm LABEL=DIR``, default ``main`` = this one): its services and its
recipe run (cwd = DIR, ``python -m deploy``), so ``--arm before=<worktree of an older commit>``
measures the old code and recipe beside today's. Arms may share a checkout and differ in config
(``--arm-set LABEL KEY=VALUE``: a recipe change measured beside the recipe as it is). The
launcher (``bring_up``) is this checkout's for every arm, so a launcher setting is an arm option of
its own (``--arm-niceness LABEL N``: the rollout side's priority; ``--arm-engine LABEL PLACE``:
the CPU engine in the rollout worker's process or a server of its own). Runs alternate between arms, so all arms see the
same machine in the same hour; the median of ``--runs`` runs per arm is reported (a run that
never reached the target counts as its whole budget, and says so). Results go to
``bench/results/learning.json`` and the plot of held-out success against wall-clock minutes, one
line per run, to ``bench/results/learning.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from deploy.demo import DEMO_CONFIG, DemoReport, evaluate, train_and_evaluate  # noqa: E402
from deploy.up import ROLLOUT_NICENESS, EnginePlace  # noqa: E402
from services.policy import policy_dir_name, policy_version  # noqa: E402
from trainer.metrics import read_metrics  # noqa: E402

TARGET_MINUTES = 4.0  # issue 15: half of the 7-9 minutes the demo took before
KEEP_EVERY_POLICY = 100_000
"""``checkpoint.keep_policies`` of a run: every published policy stays to be evaluated after it."""


def run_once(arm: str, tree: Path, index: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """One training run of ``args.minutes`` in ``tree``; its held-out curve and time to the target."""
    name = f"learning-{arm}-{index}"
    run_dir = out_dir / name
    overrides = [
        f"run.name={name}",
        f"run.output_dir={run_dir}",  # the run directory: one per run, or the next resumes it
        f"run.seed={index}",  # env seeds, sampling seeds and the trainer's RNG: run i of every arm alike
        f"optim.total_steps={args.max_steps}",
        f"checkpoint.keep_policies={KEEP_EVERY_POLICY}",
        *args.set,
        *args.arm_set.get(arm, []),
    ]
    with contextlib.chdir(tree):  # the arm's services and recipe, from its own checkout
        started = time.time()
        report = train_and_evaluate(
            DEMO_CONFIG,
            overrides,
            minutes=args.minutes,
            evaluate_before=False,
            trainer_threads=args.trainer_threads,
            rollout_niceness=args.arm_niceness.get(arm, ROLLOUT_NICENESS),
            engine_place=args.arm_engine.get(arm, EnginePlace.SERVER),
        )
        curve = held_out_curve(report, started, args.eval_every)
    reached = next((point for point in curve if point["success"] >= args.target), None)
    return {
        "arm": arm,
        "run": index,
        "minutes_to_target": reached["minutes"] if reached else None,
        "updates_to_target": reached["step"] if reached else None,
        "updates": report.steps,
        "train_minutes": report.train_minutes,
        "final_success": report.after.success,
        "final_invalid_rate": report.after.invalid_rate,
        "curve": curve,
    }


def held_out_curve(report: DemoReport, started: float, every: int) -> list[dict[str, Any]]:
    """Held-out success of every ``every``-th published policy (and the last), by the minute of
    its publication since ``started``; the last one is the run's final evaluation."""
    run_dir = report.config.run_dir
    published = {
        record["step"]: (record["time"] - started) / 60.0
        for record in read_metrics(run_dir)
        if "train/pg_loss" in record
    }
    versions = sorted(
        version
        for child in run_dir.iterdir()
        if (version := policy_version(child)) is not None and version in published
    )
    curve = []
    for version in versions:
        if version == report.steps:
            success = report.after.success
        elif version % every == 0:
            policy = run_dir / policy_dir_name(version)
            success = evaluate(report.config, policy, run_dir / "held-out" / policy.name).success
        else:
            continue
        curve.append({"step": version, "minutes": published[version], "success": success})
    return curve


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the median time and updates to the target (a miss counts as the whole budget)."""
    arms = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        mine = [run for run in runs if run["arm"] == arm]
        minutes = [run["minutes_to_target"] or run["train_minutes"] for run in mine]
        updates = [run["updates_to_target"] or run["updates"] for run in mine]
        arms[arm] = {
            "runs": len(mine),
            "reached_target": sum(run["minutes_to_target"] is not None for run in mine),
            "median_minutes_to_target": statistics.median(minutes),
            "median_updates_to_target": statistics.median(updates),
            "median_final_success": statistics.median(run["final_success"] for run in mine),
            "median_updates": statistics.median(run["updates"] for run in mine),
        }
    return arms


def plot(runs: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(dict.fromkeys(run["arm"] for run in runs), plt.get_cmap("tab10").colors, strict=False))
    figure, axes = plt.subplots(figsize=(7, 4.2))
    labelled: set[str] = set()
    for run in runs:
        points = run["curve"]
        axes.plot(
            [p["minutes"] for p in points],
            [p["success"] for p in points],
            color=colours[run["arm"]],
            alpha=0.8,
            marker=".",
            label=None if run["arm"] in labelled else run["arm"],
        )
        labelled.add(run["arm"])
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
    for column in ("arm", "runs reaching it", "median minutes", "median updates", "final success"):
        table.add_column(column, justify="right")
    for arm, row in results["arms"].items():
        table.add_row(
            arm,
            f"{row['reached_target']} / {row['runs']}",
            f"{row['median_minutes_to_target']:.1f}",
            f"{row['median_updates_to_target']:.0f}",
            f"{row['median_final_success']:.2f}",
        )
    Console(width=120).print(table)


def arm(value: str) -> tuple[str, Path]:
    """``LABEL=DIR`` -> (label, the checkout's absolute path)."""
    label, sep, tree = value.partition("=")
    path = Path(tree).expanduser().resolve()
    if not sep or not label or not (path / DEMO_CONFIG).is_file():
        raise argparse.ArgumentTypeError(f"{value!r} must be LABEL=DIR, DIR a checkout holding {DEMO_CONFIG}")
    return label, path


def commit_of(tree: Path) -> str:
    """The checkout's commit, with ``+changes`` when its tree differs from it."""
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(tree), "diff", "--quiet", "HEAD"], capture_output=True)
    return (head.stdout.strip() or "unknown") + ("+changes" if dirty.returncode else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="Runs per arm.")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="run.seed of each arm's first run (the runs take the seeds from there on): more seeds "
        "for a comparison already measured on 0, 1, 2.",
    )
    parser.add_argument(
        "--arm",
        type=arm,
        action="append",
        dest="arms",
        metavar="LABEL=DIR",
        help="A checkout to measure (repeatable); default: main=this checkout.",
    )
    parser.add_argument("--minutes", type=float, default=9.0, help="Training budget per run (the demo's).")
    parser.add_argument("--max-steps", type=int, default=1000, help="Updates at most (the budget ends runs).")
    parser.add_argument(
        "--eval-every", type=int, default=10, help="Every this many updates' policy is evaluated."
    )
    parser.add_argument("--trainer-threads", type=int, default=1, help="The trainer's torch threads.")
    parser.add_argument("--target", type=float, default=0.5, help="Held-out success to reach.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for every run (as `stargym train --set`), e.g. rollout.groups_per_batch=8.",
    )
    parser.add_argument(
        "--arm-set",
        nargs=2,
        action="append",
        default=[],
        metavar=("LABEL", "KEY=VALUE"),
        help="A config override for one arm's runs (after --set), e.g. --arm-set lr3 optim.lr=3e-3.",
    )
    parser.add_argument(
        "--arm-niceness",
        nargs=2,
        action="append",
        default=[],
        metavar=("LABEL", "N"),
        help=f"How many nice steps below the trainer one arm's rollout side runs (default {ROLLOUT_NICENESS},"
        " `stargym up`'s; the launcher is this checkout's for every arm), e.g. --arm-niceness equal 0.",
    )
    parser.add_argument(
        "--arm-engine",
        nargs=2,
        action="append",
        default=[],
        metavar=("LABEL", "PLACE"),
        help="Where one arm's CPU engine runs: 'server' (a process of its own, `stargym up`'s default) "
        "or 'worker' (in the rollout worker's process), e.g. --arm-engine inworker worker.",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "learning.json")
    parser.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        metavar="DIR",
        help="Write the run directories (policies, held-out trajectories) here and keep them; default: "
        "a temporary directory, removed at the end.",
    )
    args = parser.parse_args()
    args.arms = args.arms or [("main", REPO_ROOT)]
    labels = {label for label, _ in args.arms}

    def check_arm(flag: str, label: str) -> None:
        if label not in labels:
            parser.error(f"{flag} {label}: no --arm {label}=DIR (arms: {', '.join(sorted(labels))})")

    per_arm: dict[str, list[str]] = {}
    for label, override in args.arm_set:
        check_arm("--arm-set", label)
        per_arm.setdefault(label, []).append(override)
    args.arm_set = per_arm
    for label, _ in args.arm_niceness:
        check_arm("--arm-niceness", label)
    args.arm_niceness = {label: int(niceness) for label, niceness in args.arm_niceness}
    for label, place in args.arm_engine:
        check_arm("--arm-engine", label)
        if place not in set(EnginePlace):
            parser.error(f"--arm-engine {label}: {place!r} is not one of {', '.join(EnginePlace)}")
    args.arm_engine = {label: EnginePlace(place) for label, place in args.arm_engine}
    args.out = args.out.resolve()
    return args


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    runs = []
    with contextlib.ExitStack() as stack:
        if args.keep_runs is None:
            runs_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="stargym-bench-learning-"))
            )
        else:
            runs_dir = args.keep_runs.resolve()
            runs_dir.mkdir(parents=True, exist_ok=True)
        for index in range(args.first_seed, args.first_seed + args.runs):
            for label, tree in args.arms:
                print(
                    f"run {index - args.first_seed + 1}/{args.runs} (seed {index}), {label} ({tree}): "
                    f"up to {args.minutes:g} minutes ..."
                )
                run = run_once(label, tree, index, args, runs_dir)
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
        "seeds": list(range(args.first_seed, args.first_seed + args.runs)),
        "eval_every": args.eval_every,
        "trainer_threads": args.trainer_threads,
        "overrides": args.set,
        "arm_overrides": args.arm_set,
        "arm_niceness": args.arm_niceness,
        "arm_engine": {label: str(place) for label, place in args.arm_engine.items()},
        "arm_commits": {label: commit_of(tree) for label, tree in args.arms},
        "runtime_s": time.perf_counter() - started,
        "arms": summarise(runs),
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
