"""``preset: starpo_s`` with every other key at its default trains, through the real services.

The regression of issue 7: 16 kept groups at filter ratio 0.25 need 64 complete groups of 8 (512
jobs) in flight at once, and the in-flight limit used to default to 256, so the first batch never
came and the trainer waited forever without a word. Every key that decides the batch's geometry keeps its default
(``group_size`` 8, ``groups_per_batch`` 16, ``max_inflight`` derived, filter ratio 0.25). Set here
is only what a run cannot do without (the model: the tiny policy made for the bandit; the env
mix; the run dir; the length) and what sets the *length of an episode*, which the deadlock does
not depend on: one turn of at most 8 tokens (the bandit needs one token) and 16 held-out episodes
for the end-of-run evaluation. With the defaults there (10 turns of 256 tokens, 256 eval
episodes) the same test took 29 minutes on 2 cores, against about 5 with these.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import wait_exit

from deploy.model_init import init_tiny_model
from deploy.up import bring_up
from trainer.checkpoint import CheckpointStore
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(25 * 60)]

UPDATES = 5  # the deadlock was the first batch; 5 also cover the refills after each filtered batch


def test_starpo_s_with_defaults_trains(tmp_path: Path, empty_redis_url: str) -> None:
    redis_url = empty_redis_url
    model = init_tiny_model(tmp_path / "model", 0, ["game/bandit"], 100, 20)
    config = tmp_path / "starpo_s.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "preset": "starpo_s",
                "model": {"path": str(model)},
                "envs": {"mix": [{"id": "game/bandit"}]},
                "run": {"output_dir": str(tmp_path / "run")},
                "optim": {"total_steps": UPDATES},
                "rollout": {"sampling": {"max_tokens": 8}},
                "curriculum": {"horizon_schedule": [[0, 1]]},
                "eval": {"episodes": 16},
            }
        )
    )
    with bring_up(config, redis_url=redis_url, private=True) as stack:
        wait_exit(stack.trainer, f"the trainer to finish {UPDATES} updates", deadline_s=20 * 60)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "train/pg_loss" in r] == list(range(1, UPDATES + 1))
    assert {r["rollout/kept_ratio"] for r in records if "rollout/kept_ratio" in r} == {0.25}
    assert all(r["rollout/candidate_groups"] == 64 for r in records if "rollout/candidate_groups" in r)
    assert CheckpointStore(tmp_path / "run").latest() == UPDATES
