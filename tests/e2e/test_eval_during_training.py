"""``eval.every``: held-out evaluation during training, played by the real rollout worker.

The whole system runs as processes (``deploy.up.bring_up``). Every 2 updates the trainer issues
an eval round on the held-out seeds through the job stream; its results land in the metrics at
the step whose policy played them and in ``<run_dir>/eval.jsonl``, and no eval episode is ever
in a training batch. The trainer runs with ``--keep-serving`` (as in the containers): once done it
keeps answering ``/status`` and the dashboard until SIGTERM, and then exits 0.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
from conftest import REPO_ROOT, free_port, short_run_overrides, wait_until

from deploy.up import bring_up
from trainer.controller import read_controller_log
from trainer.dashboard.runs import read_run_status
from trainer.evaluation import eval_group_prefix
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(10 * 60)]

EPISODES = 16


def test_eval_rounds_run_every_n_updates_and_at_the_end(tmp_path: Path, empty_redis_url: str) -> None:
    redis_url = empty_redis_url
    run_dir = tmp_path / "run"
    overrides = [
        *short_run_overrides(tmp_path, "e2e-eval"),
        f"dashboard.port={free_port()}",
        "optim.total_steps=5",
        "checkpoint.save_every=5",
        "eval.every=2",
        f"eval.episodes={EPISODES}",
        "eval.temperature=0",
    ]
    with bring_up(
        REPO_ROOT / "configs/bandit-tiny.yaml",
        overrides,
        redis_url=redis_url,
        private=True,
        trainer_args=["--keep-serving"],
    ) as stack:
        status = wait_until(
            lambda: (s := stack.trainer_status()) and s["state"] in ("done", "failed") and s,
            "the trainer to finish 5 updates and its evaluations",
            deadline_s=8 * 60,
            interval_s=1.0,
            logs=[stack.trainer],
        )
        assert status["state"] == "done" and status["step"] == 5, status
        assert stack.trainer.process.poll() is None, "a done run with --keep-serving must keep serving"
        runs = httpx.get(f"{stack.trainer.url}/api/runs", timeout=10).json()["runs"]
        assert [run["name"] for run in runs] == [run_dir.name]  # the dashboard names runs by directory
        stack.trainer.process.terminate()
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (exit -15 / 143).
        assert stack.trainer.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert read_run_status(run_dir).state == "done"
        trainer_log = stack.trainer.log()

    rounds = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rounds]
    # Every 2 updates, then the final policy (step 5) at the end of the run. A round is not started
    # while the previous one is still being played, and the trainer says so: step 2's 16 episodes
    # queue behind up to 32 training jobs, and on a loaded machine two updates can come first.
    skipped = "step 4: no eval round started, the previous one is still being played"
    assert steps == [2, 4, 5] or (steps == [2, 5] and skipped in trainer_log), (steps, trainer_log[-2000:])
    for record in rounds:
        assert record["eval/episodes"] == EPISODES and record["eval/missing"] == 0
        assert 0.0 <= record["eval/game/bandit/success"] <= 1.0
        assert record["eval/success"] == record["eval/game/bandit/success"]
    metrics = {record["step"]: record for record in read_metrics(run_dir)}
    for step, record in zip(steps, rounds, strict=True):
        assert metrics[step]["eval/success"] == record["eval/success"]
        assert "train/pg_loss" in metrics[step]  # logged beside that step's training metrics
    assert all("eval/success" not in metrics[step] for step in {1, 2, 3, 4, 5} - set(steps))

    records = read_controller_log(run_dir)
    trained = {job for r in records if r["event"] == "batch" for job in r["job_ids"]}
    assert trained and not any(job.startswith(eval_group_prefix("e2e-eval")) for job in trained)
    assert sum(r["jobs"] for r in records if r["event"] == "eval") == len(steps) * EPISODES


def test_sigterm_ends_an_end_of_run_evaluation_that_cannot_finish(
    tmp_path: Path, empty_redis_url: str
) -> None:
    """The end-of-run round waits up to ``group_timeout_s`` (30 min) for its episodes; with the
    rollout worker frozen it can never finish, and a SIGTERM must still end the trainer at once,
    its last checkpoint saved and its episodes acked."""
    run_dir = tmp_path / "run"
    overrides = [
        *short_run_overrides(tmp_path, "e2e-eval-stop"),
        f"dashboard.port={free_port()}",
        "optim.total_steps=2",
        "checkpoint.save_every=2",
        "eval.episodes=512",
    ]
    with bring_up(
        REPO_ROOT / "configs/bandit-tiny.yaml", overrides, redis_url=empty_redis_url, private=True
    ) as stack:
        wait_until(
            lambda: (s := stack.trainer_status()) and s["state"] == "evaluating",
            "the trainer to start its end-of-run evaluation",
            deadline_s=5 * 60,
            interval_s=0.05,
            logs=[stack.trainer],
        )
        stack.worker.process.send_signal(signal.SIGSTOP)
        try:
            stack.trainer.process.terminate()
            assert stack.trainer.process.wait(timeout=30) in (0, -signal.SIGTERM), stack.trainer.log()[-4000:]
        finally:
            stack.worker.process.send_signal(signal.SIGCONT)
        assert "end-of-run evaluation was abandoned" in stack.trainer.log()
    assert (run_dir / "step-2").is_dir()
    assert [r["step"] for r in read_controller_log(run_dir) if r["event"] == "commit"][-1] == 2
