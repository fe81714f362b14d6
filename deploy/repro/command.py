"""``stargym repro FINDING``: train every arm of a finding on a few seeds, then plot and report.

    stargym repro echo-trap                       # 2 arms x 3 seeds, 8 minutes a run
    stargym repro filter-ratio --seeds 1 --minutes 3 --out runs/quick
    stargym repro all                             # every finding, one after the other

Each run is ``make demo``'s machinery (:func:`deploy.demo.train_and_evaluate`: Redis, the env
server, the CPU engine, a rollout worker and the trainer as real services, then the held-out
seeds played by the newest policy) in an ordinary run directory, ``OUT/<finding>/<arm>-seed-<k>``
(the report beside them, or under ``--reports``), so the dashboard's runs view overlays them too
(``stargym dashboard OUT/<finding>``). ``--parallel`` runs side by side, by default one per 4
cores: on this 2-core machine one at a time, since two runs would each get half the cores and the
arms would no longer be comparable. The order is seed-major (every arm's seed 0, then every arm's
seed 1), so a stopped sweep has covered all arms evenly, and a run directory holding its ``demo-report.json`` is finished and skipped when the
command is run again: a sweep of several hours can be resumed. An unfinished directory is started
afresh, since its time budget was spent. The seed is ``run.seed`` (sampling and update order);
every arm starts from the same initial weights.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from deploy.demo import train_and_evaluate
from deploy.repro.analysis import ArmSummary, read_run
from deploy.repro.findings import FINDINGS, Arm, Finding
from deploy.repro.report import write_index, write_report
from deploy.train import load_train_config
from trainer.config import TrainConfig

CORES_PER_RUN = 4
"""What one run's services want: ~3.4 cores when nothing holds them back (py-spy of the demo's
stack: engine 1.2, trainer 1.1, rollout worker 0.8, env server 0.3)."""

REPORT_FILE = "demo-report.json"
"""Written by :func:`deploy.demo.train_and_evaluate` when a run has finished and been evaluated."""


def default_parallel() -> int:
    """Runs side by side by default: one per :data:`CORES_PER_RUN` cores, at least one."""
    return max(1, (os.cpu_count() or 1) // CORES_PER_RUN)


def run_dir_of(out_dir: Path, arm: Arm, seed: int) -> Path:
    """``<arm>-seed-<k>`` directly under the finding's directory, where the dashboard looks for runs."""
    return out_dir / f"{arm.label.replace('/', '-')}-seed-{seed}"


def run_name(finding: Finding, arm: Arm, seed: int) -> str:
    """A run id (it names the run's Redis keys): the finding, the arm and the seed."""
    return f"{finding.name}-{run_dir_of(Path(), arm, seed).name}"


def run_arm(
    finding: Finding,
    arm: Arm,
    seed: int,
    out_dir: Path,
    minutes: float,
    extra: list[str],
    console: Console,
    redis_url: str | None = None,
    private: bool = False,
) -> None:
    """Train one seed of one arm and evaluate it; a finished run is left as it is. ``redis_url``
    and ``private`` go to :func:`deploy.demo.train_and_evaluate`."""
    run_dir = run_dir_of(out_dir, arm, seed)
    if (run_dir / REPORT_FILE).exists():
        console.print(f"  {arm.label} seed {seed}: finished earlier, kept")
        return
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted run: its budget was spent, begin it again
    overrides = [
        *arm.overrides,
        *extra,
        f"run.seed={seed}",
        f"run.name={run_name(finding, arm, seed)}",
        f"run.output_dir={run_dir}",
    ]
    console.print(f"  {arm.label} seed {seed}: training for {minutes:g} minutes …")
    started = time.monotonic()
    report = train_and_evaluate(
        arm.config, overrides, minutes=minutes, evaluate_before=False, redis_url=redis_url, private=private
    )
    console.print(
        f"  {arm.label} seed {seed}: {report.steps} updates, held-out success {report.after.success:.2f} "
        f"({(time.monotonic() - started) / 60:.1f} min with the evaluation)"
    )


def summarise(finding: Finding, out_dir: Path, seeds: int) -> dict[str, ArmSummary]:
    """Every arm with runs on disk, finished or not: a sweep of some arms (``--arm``) reports
    beside them what earlier sweeps of the others left."""
    summaries = {}
    for arm in finding.arms:
        runs = [
            read_run(run_dir, seed)
            for seed in range(seeds)
            if (run_dir := run_dir_of(out_dir, arm, seed)).is_dir()
        ]
        if runs:
            summaries[arm.label] = ArmSummary(arm.label, runs)
    return summaries


def reproduce(
    finding: Finding,
    *,
    seeds: int,
    minutes: float | None,
    out: Path,
    reports: Path | None = None,
    only: list[str],
    extra: list[str],
    console: Console,
    parallel: int = 1,
    redis_url: str | None = None,
    private: bool = False,
) -> Path:
    """Run (or resume) ``finding``'s sweep, ``parallel`` runs at a time, and write its report
    (under ``reports``, default ``out``); returns the report's path."""
    arms = [finding.arm(label) for label in only] if only else list(finding.arms)
    configs: dict[str, TrainConfig] = {
        arm.label: load_train_config(arm.config, [*arm.overrides, *extra]) for arm in finding.arms
    }  # every arm's config is checked before the first run starts
    out_dir = out / finding.name
    jobs = [(seed, arm) for seed in range(seeds) for arm in arms]
    console.rule(f"{finding.name}: {len(arms)} arms x {seeds} seeds, {parallel} at a time")

    def run(job: tuple[int, Arm]) -> None:
        seed, arm = job
        budget = minutes or arm.minutes or finding.minutes
        # Side by side, stacks must not meet on the usual ports.
        run_arm(finding, arm, seed, out_dir, budget, extra, console, redis_url, private or parallel > 1)

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, ThreadPoolExecutor(max_workers=parallel) as pool:
        task = progress.add_task(finding.name, total=len(jobs))
        for _ in pool.map(run, jobs):  # services are processes: threads only wait on them
            progress.advance(task)
    summaries = summarise(finding, out_dir, seeds)
    command = shlex.join(["stargym", *sys.argv[1:]])
    report_dir = (reports or out) / finding.name
    report_dir.mkdir(parents=True, exist_ok=True)
    report = write_report(finding, summaries, configs, command, report_dir)
    index = write_index(reports or out, list(FINDINGS.values()))
    console.print(f"{finding.name}: wrote {report}, {report.with_name('curves.png')} and {index}")
    return report


def repro_command(
    finding: Annotated[
        str, typer.Argument(help=f"One of: {', '.join(FINDINGS)}, or 'all' for every one in turn.")
    ],
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per arm.")] = 3,
    minutes: Annotated[
        float | None, typer.Option(min=0.1, help="Training budget of each run; default: the finding's.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Where the run directories go.")] = Path("runs/repro"),
    reports: Annotated[
        Path | None,
        typer.Option(help="Where each finding's report.md and curves.png go; default: --out."),
    ] = None,
    arm: Annotated[
        list[str] | None, typer.Option(help="Only this arm (repeatable); default: every arm of the finding.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="A config override for every run, e.g. eval.episodes=64 (repeatable)."),
    ] = None,
    parallel: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"Runs side by side; default: one per {CORES_PER_RUN} cores (here {default_parallel()}).",
        ),
    ] = None,
) -> None:
    """Reproduce a finding of RAGEN or AgentGym-RL at CPU scale: train its arms, plot, report."""
    if finding != "all" and finding not in FINDINGS:
        raise typer.BadParameter(f"{finding!r} is not a finding; choose one of: {', '.join(FINDINGS)}, all")
    chosen = list(FINDINGS.values()) if finding == "all" else [FINDINGS[finding]]
    if arm and len(chosen) > 1:
        raise typer.BadParameter("--arm names an arm of one finding: give that finding, not 'all'")
    console = Console(stderr=True)
    for item in chosen:
        try:
            reproduce(
                item,
                seeds=seeds,
                minutes=minutes,
                out=out,
                reports=reports,
                only=arm or [],
                extra=set_ or [],
                console=console,
                parallel=parallel or default_parallel(),
            )
        except KeyError as exc:
            raise typer.BadParameter(str(exc.args[0]), param_hint="--arm") from None
        except RuntimeError as exc:  # a run whose trainer failed: the sweep stops, finished runs stay
            console.print(
                f"[red]{item.name}: {exc}[/]\nFinished runs are kept: run the command again to resume."
            )
            raise typer.Exit(1) from None
