"""``stargym train --nproc-per-node 2``: two trainer processes (gloo) train one run, resume it, and
end where one process would have.

The whole system runs as processes (``deploy.up.bring_up``: Redis, env server, CPU engine, rollout
worker, and the trainer under torchrun). A tap reads every trajectory off the Redis stream as it
goes by (acked entries are deleted after each checkpoint). The run trains 4 updates, stops with a
checkpoint, and a second ``stargym train --nproc-per-node 2`` resumes it to 6. Then a single
:class:`~trainer.update.PolicyUpdater` in this process replays the same batches (the ``batch``
records of ``controller.jsonl`` name their job ids in order; the controller's reward shaping is
applied as it was) from the same initial weights, and its weights must match the checkpoints'.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
import torch
from conftest import REPO_ROOT, free_port, short_run_overrides, start_server, wait_exit

from deploy.train import parse_overrides
from deploy.up import bring_up
from services.policy import load_state_dict
from services.rollout_protocol import DATA_FIELD, RunKeys, Trajectory
from trainer.batch import collate
from trainer.checkpoint import CheckpointStore
from trainer.config import load_config
from trainer.controller import read_controller_log, shape_reward
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(20 * 60)]

CONFIG = REPO_ROOT / "configs/frozenlake-tiny.yaml"
FIRST, SECOND = 4, 6
RUN = "e2e-ranks"


class StreamTap:
    """Copies every entry of the run's trajectories stream, by job id, until stopped."""

    def __init__(self, url: str, run: RunKeys) -> None:
        self.client = redis.Redis.from_url(url)
        self.stream = run.trajectories
        self.seen: dict[str, Trajectory] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = "0-0"
        while not self._stop.is_set():
            reply = self.client.xread({self.stream: last}, count=1000, block=100)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    trajectory = Trajectory.model_validate_json(fields[DATA_FIELD.encode()])
                    self.seen[trajectory.job_id] = trajectory

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


def test_two_processes_train_resume_and_match_one(tmp_path: Path, empty_redis_url: str) -> None:
    redis_url = empty_redis_url
    run_dir = tmp_path / "run"
    overrides = [
        *short_run_overrides(tmp_path, RUN),
        "checkpoint.save_every=2",
        "checkpoint.keep_last=5",
        "eval.episodes=8",
        # Adam turns a gradient that cancels to rounding noise (GRPO advantages sum to 0 in a
        # group) into a step of up to ~lr x 1e-2, so two summation orders differ by that much:
        # a smaller lr keeps that below the tolerance without changing what is compared.
        "optim.lr=1e-4",
        # Float32: two summation orders compared to 1e-5, not bfloat16 rounding (`bf16: auto`
        # autocasts on an AMX CPU, and the ranks' micro-batches are padded differently).
        "optim.bf16=false",
    ]
    tap = StreamTap(redis_url, RunKeys(RUN))
    try:
        with bring_up(
            CONFIG,
            [*overrides, f"optim.total_steps={FIRST}", f"dashboard.port={free_port()}"],
            concurrency=32,
            trainer_args=["--nproc-per-node", "2"],
            redis_url=redis_url,
            private=True,
        ) as stack:
            wait_exit(stack.trainer, f"{FIRST} updates by 2 processes")
            assert "rank 1 of 2" in stack.trainer.log()
            assert CheckpointStore(run_dir, keep_last=None).latest() == FIRST

            port = free_port()
            args = ["train", str(CONFIG), "--port", str(port), "--threads", "1", "--nproc-per-node", "2"]
            for item in [*overrides, f"optim.total_steps={SECOND}"]:
                args += ["--set", item]
            second = start_server(args, port, tmp_path, env={"REDIS_URL": redis_url}, name="trainer2")
            wait_exit(second, f"the resumed run to reach {SECOND}")
            assert f"from its checkpoint of step {FIRST}" in second.log()
    finally:
        tap.stop()

    assert [r["step"] for r in read_metrics(run_dir) if "train/pg_loss" in r] == list(range(1, SECOND + 1))
    config = load_config(CONFIG, parse_overrides(overrides))
    batches = {r["step"]: r["job_ids"] for r in read_controller_log(run_dir) if r["event"] == "batch"}
    assert set(batches) >= set(range(1, SECOND + 1))

    # One process, the same batches, the same initial weights.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.update import PolicyUpdater

    model = AutoModelForCausalLM.from_pretrained(str(config.model.path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    updater = PolicyUpdater(model, config, device="cpu")
    for step in range(1, SECOND + 1):
        batch = [shape_reward(tap.seen[job], config.rollout.invalid_penalty) for job in batches[step]]
        updater.update(collate(batch, pad))
        if step in (FIRST, SECOND):
            saved = load_state_dict(run_dir / f"step-{step}" / "policy")
            replayed = updater.policy.state_dict()
            worst = max((replayed[name] - tensor).abs().max().item() for name, tensor in saved.items())
            print(f"step {step}: max |one process - two processes| = {worst:.1e}")
            assert worst < 1e-5, f"step {step}: weights differ by {worst}"
