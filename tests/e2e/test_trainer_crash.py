"""SIGKILL the trainer mid-run and restart it: it resumes from its checkpoint and loses no trajectory.

The whole system runs as processes (``deploy.up.bring_up``: env server, CPU engine, rollout worker,
trainer) on the session's Redis. Once the trainer has saved a checkpoint and trained past it, it
is killed with SIGKILL, so the trajectories it consumed after that checkpoint are pending and
unacked; a second ``stargym train`` with the same config must

* resume at the checkpoint's step (not from 0) and keep counting from there;
* re-read every trajectory the first lifetime consumed and did not commit (``controller.jsonl``
  records the groups each lifetime received and the job ids it committed): none is lost;
* never commit a trajectory twice across the two lifetimes.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import POLL, REPO_ROOT, free_port, short_run_overrides, start_server, wait_until

from deploy.up import bring_up
from trainer.checkpoint import CheckpointStore
from trainer.controller import read_controller_log
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(10 * 60)]

CONFIG = REPO_ROOT / "configs/frozenlake-tiny.yaml"
SAVE_EVERY = 3
DEADLINE_S = 240.0


def status(url: str) -> dict | None:
    try:
        response = POLL.get(f"{url}/status", timeout=2.0)
        return response.json() if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


def wait_for(predicate, url: str, what: str, process=None) -> dict:
    """The trainer's ``/status`` once ``predicate`` holds for it; fails at once if ``process`` exits."""

    def satisfied() -> dict | None:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the trainer exited with {process.returncode} while waiting for {what}")
        current = status(url)
        return current if current is not None and predicate(current) else None

    return wait_until(satisfied, what, deadline_s=DEADLINE_S, interval_s=0.2)


def test_sigkilled_trainer_resumes_without_losing_trajectories(tmp_path: Path, empty_redis_url: str) -> None:
    redis_url = empty_redis_url
    run_dir = tmp_path / "run"
    overrides = [
        *short_run_overrides(tmp_path, "e2e-crash"),
        f"dashboard.port={free_port()}",
        f"checkpoint.save_every={SAVE_EVERY}",
        "optim.total_steps=1000",
    ]
    with bring_up(CONFIG, overrides, concurrency=16, redis_url=redis_url, private=True) as stack:
        first = stack.trainer
        # Past a checkpoint, with trajectories consumed after it (pending, not yet acked).
        before = wait_for(
            lambda s: (
                (s["last_checkpoint"] or 0) >= SAVE_EVERY
                and s["step"] > s["last_checkpoint"]
                and s["uncommitted_trajectories"] > 0
            ),
            first.url,
            "a checkpoint and an update past it",
            first.process,
        )
        first.process.kill()
        first.process.wait()
        checkpoint = CheckpointStore(run_dir, keep_last=None).latest()
        assert checkpoint is not None and checkpoint >= SAVE_EVERY
        assert before["step"] > checkpoint

        port = free_port()
        args = ["train", str(CONFIG), "--port", str(port), "--threads", "1"]
        for item in overrides:  # the same run; --port wins over dashboard.port
            args += ["--set", item]
        second = start_server(args, port, tmp_path, env={"REDIS_URL": redis_url}, name="trainer2")
        try:
            resumed = wait_for(lambda s: s["state"] == "training", second.url, "the restart", second.process)
            assert resumed["resumed_from"] == checkpoint
            assert resumed["step"] >= checkpoint
            # Train on until the second lifetime has committed a checkpoint of its own.
            wait_for(
                lambda s: (s["last_checkpoint"] or 0) >= checkpoint + SAVE_EVERY,
                second.url,
                "a checkpoint of the second lifetime",
                second.process,
            )
        finally:
            second.stop()

    records = read_controller_log(run_dir)
    lifetimes = list(dict.fromkeys(r["lifetime"] for r in records))
    assert len(lifetimes) == 2, lifetimes
    one, two = lifetimes
    consumed = {  # every group a lifetime received in full ("group" records name its job ids)
        life: {
            job for r in records if r["event"] == "group" and r["lifetime"] == life for job in r["job_ids"]
        }
        for life in lifetimes
    }
    committed_lists = {
        life: [
            job for r in records if r["event"] == "commit" and r["lifetime"] == life for job in r["job_ids"]
        ]
        for life in lifetimes
    }
    committed = {life: set(jobs) for life, jobs in committed_lists.items()}
    starts = [r for r in records if r["event"] == "start"]

    # The first lifetime had consumed trajectories it never committed: the second re-read them all.
    uncommitted = consumed[one] - committed[one]
    assert uncommitted, "the kill came when nothing was pending: the test proves nothing"
    assert uncommitted <= consumed[two], f"lost: {sorted(uncommitted - consumed[two])[:5]}"
    assert starts[1]["reclaimed"] >= len(uncommitted)
    # Nothing was committed twice, within or across the lifetimes.
    all_commits = committed_lists[one] + committed_lists[two]
    assert len(all_commits) == len(set(all_commits))
    assert not committed[one] & committed[two]
    # The step went on from the checkpoint: metrics read as one run.
    steps = [record["step"] for record in read_metrics(run_dir)]
    assert steps == list(range(1, steps[-1] + 1)), steps
    assert steps[-1] >= checkpoint + SAVE_EVERY
    latest = CheckpointStore(run_dir, keep_last=None).latest()
    assert latest == steps[-1]  # the second lifetime, stopped with SIGTERM, saved where it stopped
    state = json.loads((run_dir / f"step-{latest}" / "state.json").read_text())
    assert state["controller"]["counters"]["reclaimed"] >= len(uncommitted)
