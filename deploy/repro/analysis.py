"""Reading a finding's runs back: curves, the step of collapse, echo-trap warnings, held-out success.

Every run is an ordinary run directory (``metrics.jsonl``, ``echo_trap.jsonl``,
``demo-report.json``), so what the report says can be checked against the dashboard's runs view.

Collapse, as RAGEN uses the word: after early gains, success falls and does not come back. Here
it is the first update at which the rolling mean of training success (over
:data:`COLLAPSE_WINDOW` updates) is below :data:`COLLAPSE_FRACTION` of its best rolling mean so
far, once that best has reached :data:`MIN_PEAK` (a run that never learned has nothing to
collapse from). The end-of-run held-out success says whether the run came back.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.metrics import read_metrics

COLLAPSE_WINDOW = 10
COLLAPSE_FRACTION = 0.5
MIN_PEAK = 0.1
WARNING_WINDOW = 2 * COLLAPSE_WINDOW
"""Updates either side of a collapse in which an echo-trap warning counts as about it."""
NO_SIGNAL_SHARE = 0.95
"""A run whose in-group reward std was 0 in at least this share of its updates never had a
learning signal: every group-relative advantage was zero, so what it ends at says nothing of its
method (the multi-action arms of a tiny model from random weights, which never sample a valid
``A || B`` reply: 174 of 175 updates without signal)."""
ALIKE_SHARE = 0.85
"""Of the updates from :attr:`RunResult.groups_alike_from` to a run's end, the least share with
in-group std 0. Measured in filter-ratio at lr 3e-3: its runs in the drift trap (keep-50, keep-75)
had it in 89-93% of their updates after the trap closed (the rest a stray invalid reply, worth a
penalty in one episode), a run that kept learning (keep-100) in 3%."""
ALIKE_MIN_UPDATES = 20
"""The shortest run of updates at a run's end that :attr:`RunResult.groups_alike_from` counts."""
CURVE_KEYS = ("rollout/success", "rollout/in_group_std", "train/entropy", "train/grad_norm")
"""What the report plots, per update."""


@dataclass
class RunResult:
    """One seed of one arm."""

    seed: int
    run_dir: Path
    curves: dict[str, list[tuple[int, float]]]
    """Per key of :data:`CURVE_KEYS`: (update step, value) for every update that logged it."""
    warnings: list[dict[str, Any]]
    """The run's echo-trap and no-signal events (``echo_trap.jsonl``)."""
    held_out_success: float | None
    """Sampled success of the newest policy on the held-out seeds; None if the run did not finish."""
    updates: int
    held_out_episodes: int = 0
    """Episodes behind ``held_out_success`` (0: unknown, a report from before it was recorded)."""

    @property
    def collapse_step(self) -> int | None:
        return collapse_step(self.curves.get("rollout/success", []))

    @property
    def collapse_warnings(self) -> int:
        """How many echo-trap collapse warnings the trainer logged; in a run that never collapsed,
        each one was a false alarm."""
        return sum(event["kind"] == "collapse" for event in self.warnings)

    @property
    def had_no_signal(self) -> bool:
        """Whether the in-group reward std was 0 in at least :data:`NO_SIGNAL_SHARE` of its updates."""
        spreads = [value for _, value in self.curves.get("rollout/in_group_std", [])]
        return bool(spreads) and sum(value == 0 for value in spreads) >= NO_SIGNAL_SHARE * len(spreads)

    @property
    def groups_alike_from(self) -> int | None:
        """The first update from which every group's episodes got the same reward: its in-group
        std was 0, as it was in at least :data:`ALIKE_SHARE` of the updates to the run's end
        (at least :data:`ALIKE_MIN_UPDATES` of them); None when the run kept a signal to the end.

        From there the run learnt nothing more: it had solved every episode (the bandit), or it
        was in the drift trap, failing every episode alike (a FrozenLake policy left by the one-turn
        stage with too little Down to ever reach the goal). Its held-out success is then where the
        trap left it, not where its method would have taken it."""
        spreads = self.curves.get("rollout/in_group_std", [])
        alike_from = None
        zeros = 0
        for index in range(len(spreads) - 1, -1, -1):
            step, value = spreads[index]
            zeros += value == 0
            length = len(spreads) - index
            if value == 0 and length >= ALIKE_MIN_UPDATES and zeros >= ALIKE_SHARE * length:
                alike_from = step
        return alike_from

    @property
    def warning_lead(self) -> int | None:
        """Updates from the first echo-trap warning (collapse or gradient spike) within
        :data:`WARNING_WINDOW` updates of the collapse to the collapse: positive when it came first,
        negative after; None when the run did not collapse or no warning came that near it.

        A warning far from the collapse does not count: a gradient spike at a horizon stage's start
        (from near-zero gradients) is common and says nothing of a collapse 150 updates later."""
        step = self.collapse_step
        if step is None:
            return None
        near = [
            event["step"]
            for event in self.warnings
            if event["kind"] in ("collapse", "grad_spike") and abs(event["step"] - step) <= WARNING_WINDOW
        ]
        return step - min(near) if near else None


def collapse_step(success: list[tuple[int, float]]) -> int | None:
    """The first step whose rolling success is below :data:`COLLAPSE_FRACTION` of the best rolling
    success before it (that best at least :data:`MIN_PEAK`); None if there is none."""
    window: deque[float] = deque(maxlen=COLLAPSE_WINDOW)
    peak = 0.0
    for step, value in success:
        window.append(value)
        if len(window) < COLLAPSE_WINDOW:
            continue
        rolling = statistics.fmean(window)
        if peak >= MIN_PEAK and rolling < COLLAPSE_FRACTION * peak:
            return step
        peak = max(peak, rolling)
    return None


def read_run(run_dir: Path, seed: int) -> RunResult:
    """What :mod:`deploy.repro.report` needs of one finished (or stopped) run directory."""
    curves: dict[str, list[tuple[int, float]]] = {key: [] for key in CURVE_KEYS}
    updates = 0
    for record in read_metrics(run_dir):
        if "train/pg_loss" not in record:
            continue  # an evaluation's record, not an update's
        updates = max(updates, record["step"])
        for key in CURVE_KEYS:
            if isinstance(record.get(key), int | float):
                curves[key].append((record["step"], float(record[key])))
    warnings = []
    events = run_dir / "echo_trap.jsonl"
    if events.exists():
        warnings = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    report = run_dir / "demo-report.json"
    after = json.loads(report.read_text())["after"] if report.exists() else {}
    held_out = after.get("success")
    episodes = after.get("episodes") or sum(after.get("first_actions", {}).values())
    return RunResult(seed, run_dir, curves, warnings, held_out, updates, episodes)


@dataclass
class ArmSummary:
    """One arm over its seeds."""

    label: str
    runs: list[RunResult]

    @property
    def finished(self) -> list[RunResult]:
        return [run for run in self.runs if run.held_out_success is not None]

    @property
    def mean_success(self) -> float | None:
        values = [run.held_out_success for run in self.finished if run.held_out_success is not None]
        return statistics.fmean(values) if values else None

    @property
    def success_standard_error(self) -> float | None:
        """Of :attr:`mean_success`, from its binomial spread over the held-out episodes of its seeds
        (seed-to-seed variation not counted: with one seed it cannot be); None when unknown.

        The rate in the spread is the add-one estimate ``(k + 1) / (n + 2)``: a run that solved all
        256 episodes (or none) has not shown a rate of exactly 1 (or 0), and a spread of 0 there
        would let any two such arms, or 1.00 against 0.996, pass as a direction."""
        runs = self.finished
        if not runs or any(run.held_out_episodes <= 0 for run in runs):
            return None
        variance = 0.0
        for run in runs:
            episodes = run.held_out_episodes
            rate = ((run.held_out_success or 0.0) * episodes + 1) / (episodes + 2)
            variance += rate * (1 - rate) / episodes
        return math.sqrt(variance) / len(runs)

    @property
    def without_signal(self) -> bool:
        """Every seed of the arm ran without a learning signal (:attr:`RunResult.had_no_signal`)."""
        return bool(self.runs) and all(run.had_no_signal for run in self.runs)

    @property
    def collapsed(self) -> int:
        return sum(run.collapse_step is not None for run in self.runs)

    @property
    def median_collapse_step(self) -> float:
        """Median step of collapse over seeds, a seed that never collapsed counting as infinity."""
        steps = [run.collapse_step if run.collapse_step is not None else float("inf") for run in self.runs]
        return statistics.median(steps) if steps else float("inf")
