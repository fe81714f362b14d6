"""Run directories for dashboard tests, written by the trainer's own writers (metrics, trajectories)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from services.rollout_protocol import Trajectory, Turn
from trainer.dashboard.runs import RunStatus, write_run_status
from trainer.dashboard.samples import TrajectoryRecorder
from trainer.metrics import MetricsLogger

SCRIPT = "<script>alert(1)</script>"
CONFIG_YAML = """run:
  name: {name}
envs:
  mix:
    - id: game/bandit
      weight: 1.0
algorithm:
  advantage: grpo
curriculum:
  horizon_schedule: [[0, 2], [5, 4]]
optim:
  total_steps: {total}
"""


def episode(job_id: str, group_id: str, *, reward: float, observation: str = "Pick an arm.") -> Trajectory:
    """A one-turn episode: 3 prompt tokens (mask 0), 2 sampled tokens (mask 1)."""
    return Trajectory(
        job_id=job_id,
        run_id="run",
        env="game/bandit",
        seed=7,
        group_id=group_id,
        max_turns=2,
        policy_version=1,
        turns=[
            Turn(
                observation=observation,
                response="Dragon",
                actions=["Dragon"],
                reward=reward,
                done=True,
                valid=True,
                policy_version=1,
                prompt_tokens=3,
                response_tokens=2,
            )
        ],
        token_ids=[1, 10, 11, 12, 2],
        loss_mask=[0, 0, 0, 1, 1],
        logprobs=[0.0, 0.0, 0.0, -0.25, -2.5],
        reward=reward,
        success=reward > 0.5,
        num_turns=1,
        worker_id="w1",
    )


def make_run(root: Path, name: str, *, steps: int, state: str = "done") -> Path:
    """A finished run: ``steps`` metric lines, one kept and one filtered group, an echo-trap event
    (whose message holds a ``<script>``), a status file."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(CONFIG_YAML.format(name=name, total=steps))
    logger = MetricsLogger(run_dir)
    for step in range(1, steps + 1):
        logger.log(
            step,
            {
                "rollout/success": step / steps,
                "rollout/reward_mean": math.sin(step),
                "env/game/bandit/success": step / steps,
                "train/entropy": 1.0 / step,
            },
            timestamp=1_700_000_000.0 + step,
        )
    logger.close()
    recorder = TrajectoryRecorder(run_dir)
    kept = [episode(f"g1-{i}", "g1", reward=float(i)) for i in range(2)]
    recorder.record_group(
        kept,
        status="kept",
        step=1,
        group_reward_std=0.5,
        advantages=[[0, 0, 0, 0.5, 0.5], [0, 0, 0, -0.5, -0.5]],
    )
    filtered = [episode(f"g2-{i}", "g2", reward=0.0, observation=SCRIPT) for i in range(2)]
    recorder.record_group(filtered, status="filtered", step=1, group_reward_std=0.0)
    recorder.close()
    event = {
        "kind": "collapse",
        "step": 2,
        "message": f"reward std collapsed {SCRIPT}",
        "details": {"ratio": 0.1},
    }
    (run_dir / "echo_trap.jsonl").write_text(json.dumps(event) + "\n")
    write_run_status(
        run_dir,
        RunStatus(
            run=name, state=state, step=steps, total_steps=steps, started_at=1.7e9, updated_at=1.7e9 + steps
        ),
    )
    return run_dir
