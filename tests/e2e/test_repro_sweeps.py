"""``stargym repro``: each finding's sweep runs one short arm through the real services and reports.

A smoke test, not the findings themselves (``make repro`` runs those for hours): every finding
trains one arm for two updates on a tiny policy of its env, evaluates it on 8 held-out seeds
and writes its report and plot; run again, the finished run is kept, not trained again. The arms
chosen cover each sweep's own machinery: the critic (echo-trap's StarPO-S), the variance filter,
a widening horizon on a 5x5 lake, one component of StarPO-S, several actions per turn, turn-level
credit on Sokoban.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from deploy.cli import app
from deploy.model_init import init_tiny_model
from deploy.repro.command import REPORT_FILE, reproduce, run_dir_of
from deploy.repro.findings import FINDINGS, SOKOBAN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(15 * 60)]

ARMS = {
    "echo-trap": "starpo-s",
    "filter-ratio": "keep-25",
    "scaling-inter": "scaling",
    "starpo-s-ablation": "frozenlake/clip-higher",
    "rollout-shaping": "actions-3",
    "turn-credit": "gigpo",
}


@pytest.fixture(scope="module")
def lake_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("lake") / "model", 0, ["game/frozenlake"], 20, 8)


@pytest.fixture(scope="module")
def sokoban_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("sokoban") / "model", 0, ["game/sokoban"], 20, 8)


@pytest.mark.parametrize("name", list(ARMS))
def test_a_finding_runs_one_arm_and_reports(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, empty_redis_url: str
) -> None:
    finding = FINDINGS[name]
    model = request.getfixturevalue(
        "sokoban_model" if finding.arm(ARMS[name]).config == SOKOBAN else "lake_model"
    )
    extra = [f"model.path={model}", "optim.total_steps=2", "eval.episodes=8", "checkpoint.save_every=1"]

    def sweep() -> Path:
        return reproduce(
            finding,
            seeds=1,
            minutes=5.0,
            out=tmp_path,
            only=[ARMS[name]],
            extra=extra,
            console=Console(quiet=True),
            redis_url=empty_redis_url,
            private=True,
        )

    report = sweep()
    run_dir = run_dir_of(tmp_path / name, finding.arm(ARMS[name]), 0)
    assert (run_dir / REPORT_FILE).exists()
    text = report.read_text()
    assert f"| {ARMS[name]} | " in text and "## Verdicts" in text
    assert (report.parent / "curves.png").read_bytes()[:4] == b"\x89PNG"
    mtime = (run_dir / REPORT_FILE).stat().st_mtime
    sweep()
    assert (run_dir / REPORT_FILE).stat().st_mtime == mtime  # finished: kept, not trained again


def test_the_command_refuses_unknown_findings_and_arms() -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["repro", "echo-trapp"])
    assert unknown.exit_code == 2 and "echo-trap" in unknown.output
    arm = runner.invoke(app, ["repro", "echo-trap", "--arm", "nope"])
    assert arm.exit_code == 2 and "starpo-s" in arm.output
    mixed = runner.invoke(app, ["repro", "all", "--arm", "starpo"])
    assert mixed.exit_code == 2
