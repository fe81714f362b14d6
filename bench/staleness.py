"""Staleness bias: are long episodes trained as often as they are generated?

Dropping trajectories older than ``max_staleness`` policy versions drops long episodes more often
than short ones (a long episode spans more updates), so the trainer sees fewer long episodes than
the policy plays, and learns as if long episodes were rarer. stargym bounds staleness at issue
instead (admission control, ``trainer/controller.py``) and trains every completed trajectory.

Each arm is a checkout (``--arm LABEL=DIR``, as in ``bench/learning.py``): its services and recipe
run ``configs/frozenlake-tiny.yaml`` through the real services for ``--minutes`` with a horizon
of 8 turns from the first update (``--set`` adds overrides), so episode lengths are mixed (a hole
ends one early, the cap ends the rest). Then every trajectory the trainer disposed of is read
back from the run's ``trajectories.jsonl``: *generated* is all of them (trained, dropped,
filtered), *trained* the ones an update used. Per arm it prints the episodes generated and
trained by length and the trained share of each length; an unbiased trainer trains every length
in the proportion it was played. Runs alternate between arms. Results go to
``bench/results/staleness.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is first on sys.path and bench/env_server.py would shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT / "bench"]
sys.path.insert(0, str(REPO_ROOT))

from bench.learning import arm, commit_of  # noqa: E402
from deploy.demo import DEMO_CONFIG, train_and_evaluate  # noqa: E402
from trainer.audit_log import read_jsonl  # noqa: E402
from trainer.dashboard.samples import TRAJECTORIES_FILE  # noqa: E402

MIXED_LENGTHS = ["curriculum.horizon_schedule=[[0, 8]]", "eval.episodes=8"]
"""8 turns from the first update (no one-turn stage), and a token evaluation: only training counts."""


def read_disposed(run_dir: Path) -> list[dict[str, Any]]:
    """The trajectory records the trainer wrote, ``status`` kept, dropped or filtered, with
    ``num_turns``: the newest ~80 MB of them (the file rotates, 16 MiB x 5), written as each group
    was disposed of, so kept and dropped ones are sampled alike."""
    return read_jsonl(run_dir / TRAJECTORIES_FILE)


def length_table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Generated and trained episodes by number of turns, and what share of each length trained."""
    generated = Counter(record["num_turns"] for record in records)
    trained = Counter(record["num_turns"] for record in records if record["status"] == "kept")
    dropped = Counter(
        record.get("reason", "").split(":")[0] for record in records if record["status"] == "dropped"
    )
    return {
        "generated": sum(generated.values()),
        "trained": sum(trained.values()),
        "dropped_by_kind": dict(dropped),
        "mean_turns_generated": statistics.fmean(generated.elements()) if generated else None,
        "mean_turns_trained": statistics.fmean(trained.elements()) if trained else None,
        "by_turns": {
            turns: {
                "generated": generated[turns],
                "trained": trained[turns],
                "trained_share": trained[turns] / generated[turns],
            }
            for turns in sorted(generated)
        },
    }


def run_arm(label: str, tree: Path, index: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    name = f"staleness-{label}-{index}"
    run_dir = out_dir / name
    overrides = [
        f"run.name={name}",
        f"run.output_dir={run_dir}",
        f"run.seed={index}",
        *MIXED_LENGTHS,
        *args.set,
    ]
    with contextlib.chdir(tree):  # the arm's services and recipe, from its own checkout
        report = train_and_evaluate(DEMO_CONFIG, overrides, minutes=args.minutes, evaluate_before=False)
    return {"arm": label, "run": index, "updates": report.steps, **length_table(read_disposed(run_dir))}


def render(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        print(
            f"\n{run['arm']} run {run['run']}: {run['updates']} updates, {run['generated']} episodes generated, "
            f"{run['trained']} trained, dropped {run['dropped_by_kind'] or 'none'}; mean turns "
            f"generated {run['mean_turns_generated']:.2f}, trained {run['mean_turns_trained']:.2f}"
        )
        print("| turns | generated | trained | trained share |\n|---|---|---|---|")
        for turns, row in run["by_turns"].items():
            print(f"| {turns} | {row['generated']} | {row['trained']} | {row['trained_share']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arm", type=arm, action="append", dest="arms", metavar="LABEL=DIR")
    parser.add_argument("--runs", type=int, default=1, help="Runs per arm.")
    parser.add_argument("--minutes", type=float, default=4.0, help="Training budget per run.")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Override for every run."
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "staleness.json")
    args = parser.parse_args()
    arms = args.arms or [("main", REPO_ROOT)]
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="stargym-bench-staleness-") as tmp:
        for index in range(args.runs):
            for label, tree in arms:
                print(
                    f"run {index + 1}/{args.runs}, {label} ({tree}): {args.minutes:g} minutes ...", flush=True
                )
                runs.append(run_arm(label, tree, index, args, Path(tmp)))
    render(runs)
    results = {
        "machine": platform.platform(),
        "arms": {label: {"tree": str(tree), "commit": commit_of(tree)} for label, tree in arms},
        "minutes": args.minutes,
        "overrides": [*MIXED_LENGTHS, *args.set],
        "runs": runs,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
