"""A run whose batches carry no learning signal says so: in the log, the metrics and the dashboard.

The regression of issue 16: a Sokoban recipe trained 68 updates at reward exactly -1.000, every
group identical and so every GRPO advantage zero, and nothing told the user. Here FrozenLake 4x4
is cut to one turn with no invalid-action penalty: the goal is six moves away, so every episode of
every group scores 0, for real, through the real services.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import wait_exit

from deploy.model_init import init_tiny_model
from deploy.up import bring_up
from trainer.dashboard.runs import RunReader
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(10 * 60)]

UPDATES = 8
WINDOW = 5  # EchoTrapConfig.no_signal_window's default


def test_batches_without_reward_variance_raise_the_no_signal_warning(
    tmp_path: Path, empty_redis_url: str
) -> None:
    model = init_tiny_model(tmp_path / "model", 0, ["game/frozenlake"], 20, 8)
    run_dir = tmp_path / "run"
    config = tmp_path / "flat.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(model)},
                "envs": {"mix": [{"id": "game/frozenlake", "options": {"size": 4}}]},
                "run": {"output_dir": str(run_dir)},
                "rollout": {
                    "group_size": 4,
                    "groups_per_batch": 4,
                    "invalid_penalty": 0.0,
                    "action_format": "plain",
                    "sampling": {"max_tokens": 1},
                },
                "optim": {"total_steps": UPDATES},
                "curriculum": {"horizon_schedule": [[0, 1]]},
                "eval": {"episodes": 8},
            }
        )
    )
    with bring_up(config, redis_url=empty_redis_url, private=True) as stack:
        wait_exit(stack.trainer, f"the trainer to finish {UPDATES} updates", deadline_s=8 * 60)
        log = stack.trainer.log()

    records = [r for r in read_metrics(run_dir) if "train/pg_loss" in r]
    assert [r["rollout/groups_with_signal"] for r in records] == [0.0] * UPDATES
    assert all(r["rollout/reward_mean"] == 0.0 for r in records)
    events = [json.loads(line) for line in (run_dir / "echo_trap.jsonl").read_text().splitlines()]
    no_signal = [event for event in events if event["kind"] == "no_signal"]
    assert [event["step"] for event in no_signal] == [WINDOW]
    assert no_signal[0]["details"] == {"updates": float(WINDOW), "reward_mean": 0.0}
    assert f"step {WINDOW}: no learning signal" in log
    counts = {r["step"]: r.get("train/echo_trap/no_signal") for r in records}
    assert (counts[WINDOW - 1], counts[WINDOW], counts[UPDATES]) == (0.0, 1.0, 1.0)
    assert no_signal[0] in RunReader(run_dir).events()["echo_traps"]  # what the dashboard draws and lists
