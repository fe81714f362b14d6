"""End-to-end learning: the tiny policy trained from random weights by the real system.

Real Redis (the session's ``redis-server``), a real game env server, the real CPU engine, a real
rollout worker and the real trainer, all as subprocesses (``deploy.up.bring_up``), train for a
time budget; the newest published policy is then evaluated, sampled, on 256 held-out seeds.
The targets are the issue's: FrozenLake 4x4 (at most 8 turns) success >= 0.2 with fewer than 5%
invalid replies; the bandit picks the risky arm in >= 75% of the episodes (chance: 50%).

FrozenLake's budget is a cap: the trainer evaluates every 20 updates and ends the run once a round
reaches 0.3 (``eval.stop_at_success``), which the recipe did after 2.5-6 minutes in the runs
measured (README, Performance; 4.8 minutes in this test on a slow day), so the learnt policy, not
the clock, usually ends the test.
The bandit's run ends once a round picks the risky arm 90% of the time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from deploy.demo import DemoReport, train_and_evaluate

pytestmark = [pytest.mark.slow, pytest.mark.budgeted, pytest.mark.timeout(20 * 60)]

FROZENLAKE_MINUTES = 8.0
FROZENLAKE_EVAL_EVERY = 20
FROZENLAKE_STOP_AT = 0.3
# The bandit's sampled success (the risky arm) measured here with a 2.5-minute budget: 0.27 at
# 1.3 min, 0.82 at 2.0, 0.98 at 2.5 (the clock includes the stack's start). 3 minutes leave a CI
# machine 1.3x slower than this one past 0.9; 4 cost the suite a minute more.
BANDIT_MINUTES = 3.0
BANDIT_EVAL_EVERY = 10  # the bandit's success is the risky arm's share
BANDIT_STOP_AT = 0.9


def run(
    config: str, tmp_path: Path, redis_url: str, minutes: float, name: str, extra: tuple[str, ...] = ()
) -> DemoReport:
    overrides = [
        f"run.name={name}",
        f"run.output_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        f"dashboard.port={_free_port()}",
        *extra,
    ]
    report = train_and_evaluate(REPO_ROOT / config, overrides, minutes=minutes, redis_url=redis_url)
    print(
        f"{name}: {report.steps} updates in {report.train_minutes:.1f} min; success "
        f"{report.before.success:.3f} -> {report.after.success:.3f}, invalid "
        f"{report.before.invalid_rate:.3f} -> {report.after.invalid_rate:.3f}, first actions "
        f"{report.before.first_actions} -> {report.after.first_actions}"
    )
    for point in report.curve[:: max(len(report.curve) // 10, 1)]:
        print(f"  step {point['step']:4d}  {point['minutes']:5.1f} min  success {point['success']:.3f}")
    return report


def _free_port() -> int:
    from deploy.launcher import free_port

    return free_port()


def test_frozenlake_learns(tmp_path: Path, empty_redis_url: str) -> None:
    report = run(
        "configs/frozenlake-tiny.yaml",
        tmp_path,
        empty_redis_url,
        FROZENLAKE_MINUTES,
        "e2e-frozenlake",
        (f"eval.every={FROZENLAKE_EVAL_EVERY}", f"eval.stop_at_success={FROZENLAKE_STOP_AT}"),
    )
    rounds = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    print("held-out rounds:", [(r["step"], round(r["eval/success"], 3)) for r in rounds])
    *between, final = rounds  # the last is the end-of-run round of the final policy
    # No round before the last one between updates reached the target: the first that did ended the run
    assert all(r["eval/success"] < FROZENLAKE_STOP_AT or r["eval/missing"] for r in between[:-1])
    if between and between[-1]["eval/success"] >= FROZENLAKE_STOP_AT:
        assert final["step"] - between[-1]["step"] < FROZENLAKE_EVAL_EVERY, "the run went on past its target"
    assert report.before.success == 0.0
    assert report.after.success >= 0.2, report.curve[-5:]
    assert report.after.invalid_rate < 0.05
    assert report.after.success > report.before.success


def test_bandit_learns_the_risky_arm(tmp_path: Path, empty_redis_url: str) -> None:
    report = run(
        "configs/bandit-tiny.yaml",
        tmp_path,
        empty_redis_url,
        BANDIT_MINUTES,
        "e2e-bandit",
        (f"eval.every={BANDIT_EVAL_EVERY}", f"eval.stop_at_success={BANDIT_STOP_AT}"),
    )
    assert report.after.action_share("dragon") >= 0.75, report.after.first_actions
