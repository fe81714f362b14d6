"""Held-out evaluation during training: eval rounds played by the rollout workers, and their metrics.

Every ``eval.every`` updates (and at the end of the run) the controller issues one *round*: for
each env of the mix, ``eval.episodes`` jobs on the held-out seeds (``envs.eval_seeds``, from its
start; 0 episodes: all of them) with the env's options and its ``eval_options`` over them, sampled at ``eval.temperature`` under the final horizon of the
curriculum, so that rounds at different steps measure the same task. They go through the same
job stream as training jobs, so the same workers, engines and policy versions play them, and
are told apart by their group id (``<run>-eval<step>-<lifetime>``), never trained on and not
counted in ``rollout.max_inflight``: a round is at most ``episodes x envs`` jobs and only one is
outstanding at a time. A round is finished when all its episodes are back, or ``group_timeout_s``
after it was issued (the missing ones are reported in ``eval/missing``); training goes on
meanwhile.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from services.rollout_protocol import RolloutJob, Trajectory
from trainer.config import TrainConfig

EVAL_MARK = "-eval"


def eval_group_prefix(run_id: str) -> str:
    """Group ids of eval rounds start with this; training groups' never do (``<run>-g<index>-...``)."""
    return f"{run_id}{EVAL_MARK}"


@dataclass
class EvalRound:
    """The jobs of one evaluation and the trajectories that came back."""

    step: int
    policy_version: int
    group_id: str
    job_ids: set[str]
    issued_at: float = field(default_factory=time.monotonic)
    results: dict[str, Trajectory] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.job_ids)

    def add(self, trajectory: Trajectory) -> bool:
        """Record a result; False when it is not one of this round's jobs or came twice."""
        if trajectory.job_id not in self.job_ids or trajectory.job_id in self.results:
            return False
        self.results[trajectory.job_id] = trajectory
        return True

    def record(self) -> dict[str, Any]:
        """What ``<run_dir>/eval.jsonl`` holds for this round: the step, the version and the metrics."""
        return {"step": self.step, "policy_version": self.policy_version, **eval_stats(self)}


def make_eval_jobs(
    config: TrainConfig, run_id: str, lifetime: str, step: int, version: int
) -> list[RolloutJob]:
    """One round's jobs: per env of the mix, the first ``eval.episodes`` held-out seeds."""
    seeds = config.envs.eval_seeds
    episodes = min(config.eval.episodes or len(seeds), len(seeds))
    sampling = config.rollout.sampling.model_copy(update={"temperature": config.eval.temperature})
    group_id = f"{eval_group_prefix(run_id)}{step}-{lifetime}"
    max_turns = config.eval_max_turns
    return [
        RolloutJob(
            job_id=f"{group_id}-{env_index}-{index}",
            run_id=run_id,
            env=env.id,
            seed=seeds.start + index,
            group_id=group_id,
            max_turns=max_turns,
            sampling=sampling.model_copy(update={"seed": seeds.start + index}),
            policy_version=version,
            action_format=config.rollout.action_format,
            history_turns=config.rollout.history_turns,
            options=env.held_out_options,
            agent=config.rollout.agent,
        )
        for env_index, env in enumerate(config.envs.mix)
        for index in range(episodes)
    ]


def eval_stats(round_: EvalRound) -> dict[str, float]:
    """``eval/*`` metrics of a round: success, env return (unshaped), turns, invalid share, per env.

    A failed episode (``error``) counts as unsuccessful; one that never came back is left out
    and counted in ``eval/missing``.
    """
    items = list(round_.results.values())
    metrics: dict[str, float] = {
        "eval/episodes": float(len(items)),
        "eval/missing": float(len(round_.job_ids) - len(items)),
        "eval/errors": float(sum(t.error is not None for t in items)),
    }
    if not items:
        return metrics
    turns = max(sum(t.num_turns for t in items), 1)
    metrics |= {
        "eval/success": statistics.fmean(float(t.success) for t in items),
        "eval/reward": statistics.fmean(t.reward for t in items),
        "eval/turns": statistics.fmean(t.num_turns for t in items),
        "eval/invalid_rate": sum(sum(not turn.valid for turn in t.turns) for t in items) / turns,
    }
    return metrics | per_env_stats(items, "eval")


def per_env_stats(items: list[Trajectory], prefix: str) -> dict[str, float]:
    """``<prefix>/<env>/success|reward|turns``: the means of each env's trajectories in ``items``
    (training batches report them under ``env``, evaluation rounds under ``eval``)."""
    by_env: dict[str, list[Trajectory]] = {}
    for t in items:
        by_env.setdefault(t.env, []).append(t)
    metrics: dict[str, float] = {}
    for env, members in by_env.items():
        metrics[f"{prefix}/{env}/success"] = statistics.fmean(float(t.success) for t in members)
        metrics[f"{prefix}/{env}/reward"] = statistics.fmean(t.reward for t in members)
        metrics[f"{prefix}/{env}/turns"] = statistics.fmean(t.num_turns for t in members)
    return metrics
