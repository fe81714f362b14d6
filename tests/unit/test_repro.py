"""stargym repro's pieces that need no training: arms that load, collapse detection, verdicts, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.repro.analysis import ArmSummary, RunResult, collapse_step
from deploy.repro.command import run_dir_of, summarise
from deploy.repro.findings import FINDINGS, Expectation, Finding
from deploy.repro.report import figure_of, verdict, write_index, write_report
from deploy.train import load_train_config


@pytest.mark.parametrize("finding", FINDINGS.values(), ids=list(FINDINGS))
def test_every_arm_is_a_valid_config_and_every_expectation_names_arms(finding: Finding) -> None:
    labels = {arm.label for arm in finding.arms}
    assert len(labels) == len(finding.arms)
    for arm in finding.arms:
        config = load_train_config(arm.config, list(arm.overrides))
        assert config.candidate_groups * config.rollout.group_size >= 128  # no arm plays fewer episodes
    for expectation in finding.expectations:
        assert {expectation.better, expectation.worse} <= labels


def test_filtered_arms_play_what_unfiltered_ones_play() -> None:
    episodes = {
        arm.label: (config := load_train_config(arm.config, list(arm.overrides))).candidate_groups
        * config.rollout.group_size
        for arm in FINDINGS["filter-ratio"].arms
    }
    assert set(episodes.values()) == {128}


def ramp(steps: int, top: float) -> list[tuple[int, float]]:
    return [(step, min(top, step / steps * top * 2)) for step in range(1, steps + 1)]


def test_collapse_is_a_lasting_fall_from_a_real_peak() -> None:
    rise = [(step, 0.6) for step in range(1, 41)]
    fall = [(step, 0.05) for step in range(41, 81)]
    step = collapse_step(rise + fall)
    assert step is not None and 41 < step <= 50  # the rolling mean of 10 crosses half the peak
    assert collapse_step(rise) is None
    assert (
        collapse_step([(step, 0.05 if step % 2 else 0.0) for step in range(1, 200)]) is None
    )  # never learned
    assert collapse_step(rise + [(step, 0.45) for step in range(41, 81)]) is None  # a dip, not a collapse


def run(seed: int, success: float | None, curve: list[tuple[int, float]]) -> RunResult:
    return RunResult(seed, Path(f"seed-{seed}"), {"rollout/success": curve}, [], success, len(curve))


HEALTHY = [(step, 0.6) for step in range(1, 81)]
COLLAPSING = HEALTHY[:40] + [(step, 0.0) for step in range(41, 81)]


def test_verdicts_say_when_the_runs_go_the_papers_way_and_when_not() -> None:
    arms = {
        "a": ArmSummary("a", [run(0, 0.6, HEALTHY), run(1, 0.5, HEALTHY)]),
        "b": ArmSummary("b", [run(0, 0.1, COLLAPSING), run(1, 0.2, HEALTHY)]),
    }
    assert "as the paper found" in verdict(Expectation("a", "b", "success"), arms)
    assert "**not** as the paper found" in verdict(Expectation("b", "a", "success"), arms)
    stability = verdict(Expectation("a", "b", "stability"), arms)
    assert "collapsed in 0/2 seeds" in stability and "1/2" in stability and "**not**" not in stability
    assert "**not**" in verdict(Expectation("b", "a", "stability"), arms)
    calm = {"a": arms["a"], "c": ArmSummary("c", [run(0, 0.6, HEALTHY)])}
    assert "not tested" in verdict(Expectation("a", "c", "stability"), calm)
    assert "not compared, e not in this sweep" in verdict(Expectation("a", "e", "success"), arms)
    unfinished = {"a": arms["a"], "d": ArmSummary("d", [run(0, None, HEALTHY[:5])])}
    assert "not every arm finished" in verdict(Expectation("a", "d", "success"), unfinished)


def test_a_difference_within_the_evaluations_noise_shows_no_direction() -> None:
    def arm(label: str, *successes: float) -> ArmSummary:
        runs = [
            RunResult(seed, Path(f"seed-{seed}"), {}, [], success, 100, 256)
            for seed, success in enumerate(successes)
        ]
        return ArmSummary(label, runs)

    close = {"a": arm("a", 0.15), "b": arm("b", 0.13)}  # 2 SE of the difference: 0.06
    said = verdict(Expectation("a", "b", "success"), close)
    assert "within the evaluation's noise" in said and "neither direction" in said
    assert "paper found" not in verdict(Expectation("b", "a", "success"), close)
    apart = {"a": arm("a", 0.30, 0.28), "b": arm("b", 0.13, 0.15)}
    assert verdict(Expectation("a", "b", "success"), apart).endswith(", as the paper found")
    assert arm("a", 0.5).success_standard_error == pytest.approx((0.25 / 256) ** 0.5)
    # At the ceiling or the floor the plain binomial spread is 0, and any tie passed as a direction.
    for tied in (1.0, 0.0):
        said = verdict(Expectation("a", "b", "success"), {"a": arm("a", tied), "b": arm("b", tied)})
        assert "neither direction" in said
    near_ceiling = {"a": arm("a", 1.0), "b": arm("b", 255 / 256)}
    assert "neither direction" in verdict(Expectation("a", "b", "success"), near_ceiling)


def test_an_arm_that_never_had_a_learning_signal_tests_nothing() -> None:
    def arm(label: str, success: float, zero_spread_updates: int, updates: int = 100) -> ArmSummary:
        spread = [(step, 0.0 if step <= zero_spread_updates else 0.3) for step in range(1, updates + 1)]
        curves = {
            "rollout/success": [(step, success) for step in range(1, updates + 1)],
            "rollout/in_group_std": spread,
        }
        return ArmSummary(label, [RunResult(0, Path("seed-0"), curves, [], success, updates, 256)])

    stuck = {"many-actions": arm("many-actions", 0.0, 99), "one-action": arm("one-action", 0.4, 10)}
    said = verdict(Expectation("many-actions", "one-action", "success"), stuck)
    assert "not tested, many-actions had no learning signal" in said and "paper found" not in said
    assert "not tested" in verdict(Expectation("one-action", "many-actions", "stability"), stuck)
    # Most updates without a signal, but not nearly all: it had something to learn from.
    learning = {"slow": arm("slow", 0.0, 90), "one-action": stuck["one-action"]}
    assert "**not** as the paper found" in verdict(Expectation("slow", "one-action", "success"), learning)


def test_groups_alike_from_is_where_a_run_stopped_having_anything_to_learn() -> None:
    def spread(values: list[float]) -> RunResult:
        curves = {"rollout/in_group_std": list(enumerate(values, start=1))}
        return RunResult(0, Path("seed-0"), curves, [], 0.0, len(values))

    # The drift trap: a signal while the one-turn stage teaches valid moves, none from update 57 on.
    assert spread([0.2] * 56 + [0.0] * 200).groups_alike_from == 57
    # A stray invalid reply every tenth update in the trap does not end it; every fifth does.
    assert spread([0.2] * 56 + ([0.0] * 9 + [0.1]) * 20).groups_alike_from == 57
    assert spread([0.2] * 56 + ([0.0] * 4 + [0.1]) * 40).groups_alike_from is None
    # A signal to the end, or too few alike updates at the end to say anything.
    assert spread([0.2] * 256).groups_alike_from is None
    assert spread([0.2] * 240 + [0.0] * 19).groups_alike_from is None
    assert spread([0.0] * 100).groups_alike_from == 1  # never a signal at all


def test_the_report_has_the_command_every_arm_and_a_plot(tmp_path: Path) -> None:
    finding = FINDINGS["echo-trap"]
    arms = {
        "starpo": ArmSummary("starpo", [run(0, 0.1, COLLAPSING)]),
        "starpo-s": ArmSummary("starpo-s", [run(0, 0.6, HEALTHY)]),
    }
    configs = {arm.label: load_train_config(arm.config, list(arm.overrides)) for arm in finding.arms}
    report = write_report(finding, arms, configs, "stargym repro echo-trap --seeds 1", tmp_path)
    text = report.read_text()
    assert "`stargym repro echo-trap --seeds 1`" in text
    assert "| starpo | " in text and "| starpo-s | " in text
    assert f"| {collapse_step(COLLAPSING)} | none within 20 | 0 |" in text  # starpo's collapse; no warning
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_only_a_warning_near_the_collapse_counts_as_about_it() -> None:
    def warned(*events: tuple[str, int]) -> RunResult:
        warnings = [{"kind": kind, "step": step} for kind, step in events]
        return RunResult(0, Path("seed-0"), {"rollout/success": COLLAPSING}, warnings, 0.1, 80)

    step = collapse_step(COLLAPSING)
    assert step is not None
    assert warned(("collapse", step - 3), ("grad_spike", step + 1)).warning_lead == 3
    assert warned(("collapse", step + 1)).warning_lead == -1
    assert warned(("grad_spike", step - 25)).warning_lead is None  # too early to be about it
    assert warned(("no_signal", step - 2)).warning_lead is None  # not an echo-trap warning
    assert run(0, 0.6, HEALTHY).warning_lead is None  # no collapse


def test_the_panels_fill_the_figure_with_and_without_warnings() -> None:
    """An arm without warnings once squeezed every panel into a strip (an empty unclipped line)."""
    finding = FINDINGS["echo-trap"]
    warned = RunResult(
        0, Path("seed-0"), {"rollout/success": COLLAPSING}, [{"kind": "collapse", "step": 45}], 0.1, 80
    )
    arms = {
        "starpo": ArmSummary("starpo", [warned]),
        "starpo-s": ArmSummary("starpo-s", [run(0, 0.6, HEALTHY)]),
    }
    configs = {arm.label: load_train_config(arm.config, list(arm.overrides)) for arm in finding.arms}
    assert (warned.collapse_warnings, run(0, 0.6, HEALTHY).collapse_warnings) == (1, 0)
    figure = figure_of(finding, arms, configs)
    figure.canvas.draw()
    assert min(axis.get_position().height for axis in figure.axes) > 0.3


def test_a_report_covers_every_arm_with_runs_on_disk(tmp_path: Path) -> None:
    """A sweep of one arm (--arm) reports beside it what earlier sweeps of other arms left."""
    finding = FINDINGS["echo-trap"]
    for arm in finding.arms[:1]:
        run_dir = run_dir_of(tmp_path, arm, 0)
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "time": 0.0, "train/pg_loss": 0.1, "rollout/success": 0.5}) + "\n"
        )
        (run_dir / "demo-report.json").write_text(json.dumps({"after": {"success": 0.25}}))
    summaries = summarise(finding, tmp_path, seeds=3)
    assert list(summaries) == [finding.arms[0].label]  # the other arm has no run yet
    (only,) = summaries[finding.arms[0].label].runs
    assert (only.held_out_success, only.updates, only.curves["rollout/success"]) == (0.25, 1, [(1, 0.5)])


def test_the_index_lists_every_finding_with_its_verdicts_or_says_it_was_not_run(tmp_path: Path) -> None:
    finding = FINDINGS["echo-trap"]
    arms = {
        "starpo": ArmSummary("starpo", [run(0, 0.1, COLLAPSING)]),
        "starpo-s": ArmSummary("starpo-s", [run(0, 0.6, HEALTHY)]),
    }
    configs = {arm.label: load_train_config(arm.config, list(arm.overrides)) for arm in finding.arms}
    (tmp_path / finding.name).mkdir()
    write_report(finding, arms, configs, "stargym repro echo-trap --seeds 1", tmp_path / finding.name)
    index = write_index(tmp_path, list(FINDINGS.values())).read_text()
    assert "[echo-trap/report.md](echo-trap/report.md)" in index
    assert "starpo-s collapses less or later than starpo" in index  # its verdicts, copied
    for other in FINDINGS:
        if other != "echo-trap":
            assert f"Not run yet: `stargym repro {other}`." in index
