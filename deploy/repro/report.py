"""A finding's report: curves per arm (PNG) and ``report.md`` with the table and the verdicts;
and the index of every finding reported under one directory (``README.md``).

The curves are training-time numbers per update (success, in-group reward std, entropy, gradient
norm), the mean over seeds with a band from the lowest to the highest seed, ScalingInter-RL stage
starts as dashed lines in the arm's colour and echo-trap warnings as red marks; the table has the
end-of-run held-out success and each seed's step of collapse. A verdict compares two arms the way
the paper did and says plainly when the runs do not go the paper's way.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deploy.repro.analysis import (
    ALIKE_MIN_UPDATES,
    ALIKE_SHARE,
    COLLAPSE_FRACTION,
    COLLAPSE_WINDOW,
    CURVE_KEYS,
    MIN_PEAK,
    NO_SIGNAL_SHARE,
    WARNING_WINDOW,
    ArmSummary,
    RunResult,
)
from deploy.repro.findings import Expectation, Finding
from trainer.config import TrainConfig

TITLES = {
    "rollout/success": "training success",
    "rollout/in_group_std": "in-group reward std",
    "train/entropy": "entropy",
    "train/grad_norm": "gradient norm",
}
WARNING_COLOUR = "#d62728"
NOISE_SIGMAS = 2.0
"""A success difference smaller than this many standard errors of it shows no direction."""


def verdict(expectation: Expectation, arms: dict[str, ArmSummary]) -> str:
    """One line: the paper's direction for two arms, what the runs showed, and whether they agree."""
    missing = [label for label in (expectation.better, expectation.worse) if label not in arms]
    if missing:  # a sweep of some arms (--arm)
        return f"{expectation.better} vs {expectation.worse}: not compared, {' and '.join(missing)} not in this sweep"
    better, worse = arms[expectation.better], arms[expectation.worse]
    untrained = [arm.label for arm in (better, worse) if arm.without_signal]
    if untrained:
        return (
            f"{better.label} vs {worse.label}: not tested, {' and '.join(untrained)} had no learning "
            f"signal in any seed (in-group reward std 0 in at least {NO_SIGNAL_SHARE:.0%} of the updates: "
            "every group's episodes got the same reward), so it could not learn, whatever its method"
        )
    if expectation.by == "success":
        high, low = better.mean_success, worse.mean_success
        if high is None or low is None:
            return f"{better.label} vs {worse.label}: not every arm finished a run"
        agrees = high >= low
        shown = f"held-out success {high:.2f} vs {low:.2f}"
        claim = f"{better.label} ends at least as high as {worse.label}"
        errors = [better.success_standard_error, worse.success_standard_error]
        if None not in errors:
            noise = NOISE_SIGMAS * math.hypot(*errors)  # type: ignore[arg-type]
            if abs(high - low) < noise:
                return (
                    f"{better.label} vs {worse.label}: held-out success {high:.2f} vs {low:.2f}, a difference "
                    f"within the evaluation's noise (±{noise:.2f}, {NOISE_SIGMAS:g} standard errors): "
                    "neither direction is shown"
                )
    else:
        if better.collapsed == worse.collapsed == 0:
            return (
                f"{better.label} vs {worse.label}: neither collapsed in any seed, so stability is not tested"
            )
        agrees = better.collapsed < worse.collapsed or (
            better.collapsed == worse.collapsed and better.median_collapse_step > worse.median_collapse_step
        )
        shown = (
            f"collapsed in {better.collapsed}/{len(better.runs)} seeds (median step "
            f"{_step(better.median_collapse_step)}) vs {worse.collapsed}/{len(worse.runs)} "
            f"(median step {_step(worse.median_collapse_step)})"
        )
        claim = f"{better.label} collapses less or later than {worse.label}"
    mark = "as the paper found" if agrees else "**not** as the paper found"
    return f"{claim}: {shown}, {mark}"


def _lead(run: RunResult) -> str:
    """A table cell: how far the echo-trap warning came before (or after) the run's collapse."""
    if run.collapse_step is None:
        return "—"
    lead = run.warning_lead
    if lead is None:
        return f"none within {WARNING_WINDOW}"
    if lead == 0:
        return "at the same update"
    updates = "update" if abs(lead) == 1 else "updates"
    return f"{lead} {updates} before" if lead > 0 else f"{-lead} {updates} after"


def _step(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:g}"


def plot(finding: Finding, arms: dict[str, ArmSummary], configs: dict[str, TrainConfig], out: Path) -> None:
    """``out``: the PNG of :func:`figure_of`."""
    import matplotlib.pyplot as plt

    figure = figure_of(finding, arms, configs)
    figure.savefig(out, dpi=100)
    plt.close(figure)


def figure_of(finding: Finding, arms: dict[str, ArmSummary], configs: dict[str, TrainConfig]) -> Any:
    """Four panels (:data:`CURVE_KEYS` against the update step), one line per arm; a matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(arms, plt.get_cmap("tab10").colors, strict=False))
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True, layout="constrained")
    for axis, key in zip(axes.flat, CURVE_KEYS, strict=True):
        for label, arm in arms.items():
            steps, mean, low, high = _band([run.curves.get(key, []) for run in arm.runs])
            if not steps:
                continue
            axis.plot(steps, mean, color=colours[label], label=label, linewidth=1.3)
            if len(arm.runs) > 1:
                axis.fill_between(steps, low, high, color=colours[label], alpha=0.15, linewidth=0)
            for stage_step, _ in configs[label].curriculum.horizon_schedule[1:]:
                axis.axvline(stage_step, color=colours[label], linestyle="--", linewidth=0.8, alpha=0.6)
            fired = [event["step"] for run in arm.runs for event in run.warnings]
            if key == "rollout/success" and fired:
                # Unclipped, so the marks sit above the panel; an empty unclipped line would count as
                # a point at the figure's origin in the layout and squeeze every panel into a strip.
                axis.plot(fired, [1.02] * len(fired), "v", color=WARNING_COLOUR, markersize=5, clip_on=False)
        axis.set_title(TITLES[key])
        axis.grid(alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("update step")
    axes[0][0].set_ylim(0, 1.05)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{finding.title}\n(mean over seeds, band: lowest to highest; ▼ a training warning)")
    return figure


def _band(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per step that any seed logged: the mean, lowest and highest value over the seeds that logged it."""
    by_step: dict[int, list[float]] = {}
    for points in series:
        for step, value in points:
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (
        steps,
        [statistics.fmean(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def write_report(
    finding: Finding,
    arms: dict[str, ArmSummary],
    configs: dict[str, TrainConfig],
    command: str,
    out_dir: Path,
) -> Path:
    """``out_dir/report.md`` and ``out_dir/curves.png``; returns the report's path."""
    plot(finding, arms, configs, out_dir / "curves.png")
    lines = [
        f"# {finding.title}",
        "",
        f"**The paper.** {finding.paper}",
        "",
        f"**Command.** `{command}`",
        "",
        f"**Machine.** {os.cpu_count()} CPU cores, {platform.platform()}, Python {platform.python_version()}; "
        f"written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        *(f"- {note}" for note in finding.notes),
        *([""] if finding.notes else []),
        "## Verdicts",
        "",
        *(f"- {verdict(expectation, arms)}" for expectation in finding.expectations),
        "",
        "## Arms",
        "",
        "| arm | overrides | seeds | updates | held-out success (mean; per seed) | collapse step per seed | "
        "echo-trap warning near the collapse | collapse warnings | groups alike from |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, arm in arms.items():
        overrides = " ".join(f"`{item}`" for item in finding.arm(label).overrides) or "the recipe"
        mean = arm.mean_success
        per_seed = ", ".join(
            "—" if run.held_out_success is None else f"{run.held_out_success:.2f}" for run in arm.runs
        )
        collapses = ", ".join(
            str(run.collapse_step) if run.collapse_step is not None else "none" for run in arm.runs
        )
        warned = ", ".join(_lead(run) for run in arm.runs)
        warnings = ", ".join(str(run.collapse_warnings) for run in arm.runs)
        updates = ", ".join(str(run.updates) for run in arm.runs)
        alike = ", ".join(
            "—" if run.groups_alike_from is None else str(run.groups_alike_from) for run in arm.runs
        )
        success = "—" if mean is None else f"{mean:.2f}; {per_seed}"
        lines.append(
            f"| {label} | {overrides} | {len(arm.runs)} | {updates} | {success} | {collapses} | {warned} "
            f"| {warnings} | {alike} |"
        )
    lines += [
        "",
        f"Collapse: the first update whose success over the last {COLLAPSE_WINDOW} updates is below "
        f"{COLLAPSE_FRACTION:g}x the best such mean before it (once that best reached {MIN_PEAK:g}). "
        f"Warning near the collapse: the first echo-trap warning (collapse or gradient spike) within "
        f"{WARNING_WINDOW} updates of it, before or after. "
        "Collapse warnings: the trainer's echo-trap warnings per seed (each one in a run that did not "
        "collapse was a false alarm). "
        f"Groups alike from: the update from which every group's episodes got the same reward (in "
        f"at least {ALIKE_SHARE:.0%} of the updates to the end, {ALIKE_MIN_UPDATES} at least), "
        "so nothing more was learnt: a solved env, or the drift trap where every episode fails alike. "
        "Held-out success: the newest policy on the recipe's held-out seeds, sampled.",
        "",
        "![curves](curves.png)",
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


INDEX_FILE = "README.md"


def write_index(reports_dir: Path, findings: list[Finding]) -> Path:
    """``reports_dir/README.md``: every finding, its command, and its verdicts where its report is
    on disk (reports are written one finding at a time, so a sweep spread over several sessions
    leaves some findings not yet run: the index says which). Returns its path."""
    lines = [
        "# Reproductions of RAGEN and AgentGym-RL at CPU scale",
        "",
        "Written by `stargym repro` (`make repro` runs every finding). Each finding's report has the "
        "command, the machine, every arm's overrides, held-out success, each seed's step of collapse "
        "and the curves.",
        "",
    ]
    for finding in findings:
        report = reports_dir / finding.name / "report.md"
        lines.append(f"## {finding.title}")
        lines.append("")
        if not report.exists():
            lines += [f"Not run yet: `stargym repro {finding.name}`.", ""]
            continue
        text = report.read_text()
        verdicts = text.split("## Verdicts", 1)[-1].split("## Arms", 1)[0].strip()
        command = next((line for line in text.splitlines() if line.startswith("**Command.**")), "")
        lines += [f"[{finding.name}/report.md]({finding.name}/report.md) · {command}", "", verdicts, ""]
    path = reports_dir / INDEX_FILE
    path.write_text("\n".join(lines))
    return path
