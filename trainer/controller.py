"""The controller: issues rollout jobs, gathers trajectories into groups, and hands out update batches.

DESIGN.md ("Delivery", "Training") and issue 4, item 4. The controller owns the two Redis streams
on the trainer's side:

* **issuing**: each new *group* draws an env from the config's mix (by weight) and the next seed
  of the train split; its ``group_size`` jobs share env, seed and ``group_id`` and get distinct
  sampling seeds. Max turns come from the ScalingInter-RL schedule at the current update step,
  ``policy_version`` is the version being served. At most ``max_inflight`` jobs are outstanding:
  issued and not yet disposed of (queued, being played, or delivered and waiting for a batch),
  so rollouts never run more than about one batch ahead of the updates.
* **grouping**: trajectories are consumed in the ``trainer`` group and collected by ``group_id``;
  a group is *complete* when all ``group_size`` of its trajectories arrived. A complete group with
  an untrainable member (``Trajectory.untrainable_reason``: failed episode, text-only) is dropped,
  the reason logged and counted; so is a group older than ``max_staleness`` policy versions when
  a batch is assembled.
* **StarPO-S**: with the filter on, a batch is cut from the smallest number of complete groups whose
  ``filter_ratio`` share is ``groups_per_batch`` (so the update keeps its configured size: more
  groups are issued to refill it); the kept groups are those with the highest in-group reward std
  (``std_rev``: the lowest) and the rest are dropped. The kept ratio is reported.
* **acknowledging**: nothing is acked when it is consumed. Every trajectory that was used, filtered
  out or dropped waits in :attr:`Controller.uncommitted` until :meth:`Controller.commit`, which
  the trainer calls right after the checkpoint of the update that used them is saved. A trainer
  that dies re-reads on restart (``XAUTOCLAIM`` from idle 0) everything it had consumed and not
  committed: no trajectory is lost, none is used twice.

Everything the controller does is appended to ``<run_dir>/controller.jsonl`` (one JSON object a
line: ``issue`` per group, ``consume`` per trajectory, ``drop`` per dropped group, ``commit`` per
checkpoint), so delivery can be audited across trainer lifetimes. Its own counters and the seed
cursor are the ``controller_state`` of a checkpoint (:meth:`Controller.state_dict`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import statistics
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.queue import Delivery, StreamQueue, job_queue, trajectory_queue
from services.rollout_protocol import RolloutJob, Trajectory
from trainer.algorithms.filtering import num_groups_to_keep, select_groups
from trainer.config import TrainConfig

logger = logging.getLogger(__name__)

CONTROLLER_LOG = "controller.jsonl"
TRAINER_CONSUMER = "trainer"
"""The trainer's consumer name in the ``trainer`` group: the same in every lifetime, so that a
restarted trainer finds its own pending entries (it reclaims them anyway, whatever the name)."""
_MAX_REASON_LOGS = 20


@dataclass
class Group:
    """The trajectories of one ``group_id``, with the stream entries they came from."""

    group_id: str
    env: str
    entries: list[Delivery[Trajectory]] = field(default_factory=list)
    completed_at: float = 0.0

    @property
    def trajectories(self) -> list[Trajectory]:
        return [delivery.model for delivery in self.entries]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def oldest_version(self) -> int:
        return min(t.policy_version for t in self.trajectories)

    @property
    def reward_std(self) -> float:
        return statistics.pstdev(self.rewards) if len(self.entries) > 1 else 0.0


@dataclass
class Batch:
    """What one update trains on: ``groups_per_batch`` complete, fresh, trainable groups."""

    groups: list[Group]
    kept_ratio: float
    """Share of candidate groups the StarPO-S filter kept (1.0 with the filter off)."""
    candidates: int
    """Complete groups looked at to cut this batch."""
    wait_s: float
    """How long the trainer waited for the batch."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group.trajectories]


class Controller:
    """Issues jobs and assembles update batches; see the module docstring.

    Use: ``await start(...)``, then per update ``batch = await next_batch()``, after the update
    :meth:`set_progress`, after each checkpoint ``await commit()``; ``await close()`` at the end.
    """

    def __init__(
        self,
        config: TrainConfig,
        redis: Redis,
        *,
        run_dir: str | Path | None = None,
        consumer: str = TRAINER_CONSUMER,
        poll_ms: int = 200,
    ) -> None:
        self.config = config
        self.redis = redis
        self.consumer = consumer
        self.poll_ms = poll_ms
        self.jobs: StreamQueue[RolloutJob] = job_queue(redis)
        self.trajectories: StreamQueue[Trajectory] = trajectory_queue(redis)
        self.run_id = config.run.name
        self.lifetime = uuid.uuid4().hex[:8]
        self.schedule = config.curriculum.schedule
        self.step = 0
        self.policy_version = 0
        # -- state saved in checkpoints
        self.groups_issued = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "jobs_issued",
                "trajectories_consumed",
                "trajectories_used",
                "dropped_stale",
                "dropped_untrainable",
                "dropped_foreign",
                "duplicates",
                "groups_filtered",
                "reclaimed",
            ),
            0,
        )
        # -- in memory only (what is not committed is re-read after a crash)
        self._partial: dict[str, Group] = {}
        self._ready: list[Group] = []
        self._seen: set[str] = set()
        self._uncommitted: list[Delivery[Trajectory]] = []
        self._outstanding_jobs = 0
        self._changed = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._reason_logs = 0
        self._closed = False
        self._log_file = None
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._log_file = (Path(run_dir) / CONTROLLER_LOG).open("a", encoding="utf-8")

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(
        self, state: dict[str, Any] | None = None, *, step: int = 0, policy_version: int = 0
    ) -> None:
        """Restore ``state`` (a checkpoint's controller_state), re-read what a previous lifetime
        consumed and did not commit, and start issuing and consuming in the background."""
        if state:
            self.load_state_dict(state)
        self.set_progress(step, policy_version)
        await self.jobs.ensure_group()
        await self.trajectories.ensure_group()
        reclaimed = 0
        while True:
            deliveries = await self.trajectories.reclaim(self.consumer, min_idle_ms=0, count=500)
            fresh = [d for d in deliveries if d.model.job_id not in self._seen]
            if not fresh:
                break
            reclaimed += len(fresh)
            for delivery in fresh:
                self._accept(delivery, reclaimed=True)
        if reclaimed:
            self.counters["reclaimed"] += reclaimed
            logger.info("re-read %d trajectories consumed but not committed by an earlier trainer", reclaimed)
        self._write({"event": "start", "step": step, "version": policy_version, "reclaimed": reclaimed})
        self._pump_task = asyncio.create_task(self._pump(), name="controller-pump")

    async def close(self) -> None:
        """Stop issuing and consuming; uncommitted trajectories stay pending in Redis."""
        self._closed = True
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
            self._pump_task = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def set_progress(self, step: int, policy_version: int) -> None:
        """The update step (for the horizon schedule) and the policy version now published."""
        self.step = step
        self.policy_version = policy_version

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"groups_issued": self.groups_issued, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups_issued = int(state.get("groups_issued", 0))
        for key, value in state.get("counters", {}).items():
            self.counters[key] = int(value)

    @property
    def uncommitted(self) -> int:
        """Trajectories disposed of (used, filtered, dropped) and not yet acked."""
        return len(self._uncommitted)

    @property
    def outstanding(self) -> int:
        """Jobs issued and not yet disposed of, as the in-flight limit counts them."""
        return self._outstanding_jobs

    @property
    def max_turns(self) -> int:
        return self.schedule.max_turns(self.step)

    # -- issuing --------------------------------------------------------------------------------

    def _group_env(self, index: int) -> Any:
        mix = self.config.envs.mix
        if len(mix) == 1:
            return mix[0]
        rng = random.Random(self.config.run.seed * 1_000_003 + index)
        return rng.choices(mix, weights=[env.weight for env in mix])[0]

    def make_group_jobs(self, index: int) -> list[RolloutJob]:
        """The jobs of the ``index``-th group of the run: deterministic but for ids and times."""
        rollout = self.config.rollout
        env = self._group_env(index)
        seeds = self.config.envs.train_seeds
        seed = seeds.start + index % len(seeds)
        # Ids are unique per trainer lifetime: a restarted trainer reissues group indices, and a
        # reused job id would be deduplicated away by the workers (stargym:done:<job_id>).
        group_id = f"{self.run_id}-g{index}-{self.lifetime}"
        base = (self.config.run.seed * 7_919 + index * rollout.group_size) % (2**31 - 1)
        return [
            RolloutJob(
                job_id=f"{group_id}-{member}",
                run_id=self.run_id,
                env=env.id,
                seed=seed,
                group_id=group_id,
                max_turns=self.max_turns,
                sampling=rollout.sampling.model_copy(update={"seed": base + member}),
                policy_version=self.policy_version,
                action_format=rollout.action_format,
                options=env.options,
            )
            for member in range(rollout.group_size)
        ]

    async def _issue(self) -> int:
        """Publish whole groups while the in-flight limit allows; returns jobs issued."""
        group_size = self.config.rollout.group_size
        room = self.config.rollout.max_inflight - self._outstanding_jobs
        groups = max(room // group_size, 0)
        if groups == 0:
            return 0
        jobs: list[RolloutJob] = []
        first = self.groups_issued
        for index in range(first, first + groups):
            jobs += self.make_group_jobs(index)
        await self.jobs.publish_many(jobs)
        self.groups_issued += groups
        self._outstanding_jobs += len(jobs)
        self.counters["jobs_issued"] += len(jobs)
        for start in range(0, len(jobs), group_size):
            members = jobs[start : start + group_size]
            self._write(
                {
                    "event": "issue",
                    "group_id": members[0].group_id,
                    "env": members[0].env,
                    "seed": members[0].seed,
                    "max_turns": members[0].max_turns,
                    "version": members[0].policy_version,
                    "job_ids": [job.job_id for job in members],
                }
            )
        return len(jobs)

    # -- consuming ------------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Background loop: top the job queue up, read trajectories, group them."""
        delay = 0.2
        while not self._closed:
            try:
                await self._issue()
                deliveries = await self.trajectories.consume(self.consumer, count=512, block_ms=self.poll_ms)
                for delivery in deliveries:
                    self._accept(delivery)
                delay = 0.2
            except asyncio.CancelledError:
                raise
            except RedisError as exc:
                logger.warning("Redis error in the controller: %s: %s; retrying", type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except Exception as exc:  # a bug: make next_batch raise instead of hanging
                logger.exception("the controller stopped")
                self._error = exc
                self._changed.set()
                return

    def _accept(self, delivery: Delivery[Trajectory], reclaimed: bool = False) -> None:
        trajectory = delivery.model
        self._write(
            {
                "event": "consume",
                "job_id": trajectory.job_id,
                "entry_id": delivery.entry_id,
                "group_id": trajectory.group_id,
                "reclaimed": reclaimed,
            }
        )
        trajectory = shape_reward(trajectory, self.config.rollout.invalid_penalty)
        delivery = Delivery(delivery.entry_id, trajectory)
        if trajectory.job_id in self._seen:
            self.counters["duplicates"] += 1
            self._uncommitted.append(delivery)
            return
        self._seen.add(trajectory.job_id)
        self.counters["trajectories_consumed"] += 1
        if trajectory.run_id != self.run_id:
            self.counters["dropped_foreign"] += 1
            self._log_reason(f"trajectory of run {trajectory.run_id!r} in run {self.run_id!r}: dropped")
            self._uncommitted.append(delivery)
            return
        if not trajectory.group_id.endswith(self.lifetime):
            # A job an earlier trainer lifetime issued: not counted as outstanding here yet.
            self._outstanding_jobs += 1
        group = self._partial.setdefault(trajectory.group_id, Group(trajectory.group_id, trajectory.env))
        group.entries.append(delivery)
        if len(group.entries) >= self.config.rollout.group_size:
            del self._partial[trajectory.group_id]
            group.completed_at = time.monotonic()
            self._complete(group)

    def _complete(self, group: Group) -> None:
        reasons = [reason for t in group.trajectories if (reason := untrainable_reason(t)) is not None]
        if reasons:
            self.counters["dropped_untrainable"] += len(group.entries)
            self._drop(group, "untrainable", f"{len(reasons)} untrainable: {reasons[0]}")
            return
        self._ready.append(group)
        self._changed.set()

    def _drop(self, group: Group, kind: str, reason: str) -> None:
        self._log_reason(f"group {group.group_id} dropped ({kind}): {reason}")
        self._write({"event": "drop", "group_id": group.group_id, "kind": kind, "reason": reason})
        self._dispose(group)

    def _dispose(self, group: Group) -> None:
        self._uncommitted += group.entries
        self._outstanding_jobs = max(self._outstanding_jobs - len(group.entries), 0)

    def _log_reason(self, message: str) -> None:
        self._reason_logs += 1
        if self._reason_logs <= _MAX_REASON_LOGS:
            logger.warning(message)
        elif self._reason_logs == _MAX_REASON_LOGS + 1:
            logger.warning("further drops are counted in rollout/dropped_* only")

    # -- batches --------------------------------------------------------------------------------

    def _candidates_needed(self) -> int:
        rollout = self.config.rollout
        flt = self.config.starpo_s.filter
        if not flt.enabled:
            return rollout.groups_per_batch
        needed = math.ceil(rollout.groups_per_batch / flt.ratio)
        while num_groups_to_keep(needed, flt.ratio) < rollout.groups_per_batch:
            needed += 1
        return needed

    def _drop_stale(self) -> None:
        limit = self.policy_version - self.config.rollout.max_staleness
        fresh = []
        for group in self._ready:
            if group.oldest_version < limit:
                self.counters["dropped_stale"] += len(group.entries)
                self._drop(
                    group,
                    "stale",
                    f"sampled under v{group.oldest_version}, now v{self.policy_version} "
                    f"(max_staleness {self.config.rollout.max_staleness})",
                )
            else:
                fresh.append(group)
        self._ready = fresh

    async def next_batch(self, timeout_s: float | None = None) -> Batch:
        """Wait for enough complete, fresh groups and cut one update batch from them."""
        started = time.monotonic()
        needed = self._candidates_needed()
        while True:
            if self._error is not None:
                raise RuntimeError("the controller's background loop failed") from self._error
            self._drop_stale()
            if len(self._ready) >= needed:
                break
            self._changed.clear()
            remaining = None if timeout_s is None else timeout_s - (time.monotonic() - started)
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no batch within {timeout_s} s ({len(self._ready)}/{needed} groups)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining or 5.0, 5.0))
        candidates, self._ready = self._ready[:needed], self._ready[needed:]
        groups_per_batch = self.config.rollout.groups_per_batch
        flt = self.config.starpo_s.filter
        if flt.enabled:
            result = select_groups({g.group_id: g.rewards for g in candidates}, flt.ratio, flt.mode)
            kept_ids = set(result.kept_ids)
            kept = [g for g in candidates if g.group_id in kept_ids]
            sign = -1.0 if flt.mode == "std" else 1.0
            kept = sorted(kept, key=lambda g: sign * result.stds[g.group_id])[:groups_per_batch]
            kept_ids = {g.group_id for g in kept}
            for group in candidates:
                if group.group_id not in kept_ids:
                    self.counters["groups_filtered"] += 1
                    self._write({"event": "drop", "group_id": group.group_id, "kind": "filtered"})
                    self._dispose(group)
            kept_ratio = len(kept) / len(candidates)
        else:
            kept, kept_ratio = candidates, 1.0
        for group in kept:
            self._dispose(group)
        self.counters["trajectories_used"] += sum(len(g.entries) for g in kept)
        return Batch(kept, kept_ratio, len(candidates), time.monotonic() - started)

    # -- acknowledging --------------------------------------------------------------------------

    async def commit(self, step: int) -> int:
        """Ack every trajectory disposed of so far: call it after the checkpoint of ``step`` is saved."""
        deliveries, self._uncommitted = self._uncommitted, []
        if not deliveries:
            return 0
        try:
            await self.trajectories.ack([d.entry_id for d in deliveries])
        except BaseException:
            self._uncommitted = deliveries + self._uncommitted
            raise
        self._write({"event": "commit", "step": step, "job_ids": [d.model.job_id for d in deliveries]})
        return len(deliveries)

    # -- metrics --------------------------------------------------------------------------------

    async def queue_metrics(self) -> dict[str, float]:
        """``system/*`` queue depths from Redis and the controller's own buffers."""
        jobs = await self.jobs.depth()
        trajectories = await self.trajectories.depth()
        return {
            "system/queue/jobs_waiting": jobs.lag,
            "system/queue/jobs_running": jobs.pending,
            "system/queue/trajectories_waiting": trajectories.lag,
            "system/queue/trajectories_pending_ack": trajectories.pending,
            "system/queue/dead_letters": jobs.dead + trajectories.dead,
            "system/inflight_jobs": self._outstanding_jobs,
            "system/partial_groups": len(self._partial),
            "system/ready_groups": len(self._ready),
        }

    def counter_metrics(self) -> dict[str, float]:
        return {f"rollout/{name}": float(value) for name, value in self.counters.items()}

    # -- log ------------------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        if self._log_file is None:
            return
        record = {"t": round(time.time(), 3), "lifetime": self.lifetime, **record}
        self._log_file.write(json.dumps(record) + "\n")
        self._log_file.flush()


def shape_reward(trajectory: Trajectory, invalid_penalty: float) -> Trajectory:
    """``trajectory`` with ``invalid_penalty x (invalid turns / turns)`` added to its return.

    The plain action format has no format penalty, so a policy that never names a valid action
    gets no reward signal at all; this is the trainer's equivalent of RAGEN's format penalty. It
    is a *share* of the turns, not a count, so that ending an episode early (walking into a hole)
    never pays: an episode of valid moves gets 0 however long it is. Each invalid turn carries
    ``invalid_penalty / turns`` of it, so per-turn rewards still sum to the return.
    """
    invalid = sum(not turn.valid for turn in trajectory.turns)
    if invalid_penalty == 0.0 or invalid == 0:
        return trajectory
    share = invalid_penalty / len(trajectory.turns)
    turns = [
        turn if turn.valid else turn.model_copy(update={"reward": turn.reward + share})
        for turn in trajectory.turns
    ]
    return trajectory.model_copy(update={"turns": turns, "reward": trajectory.reward + invalid * share})


def untrainable_reason(trajectory: Trajectory) -> str | None:
    """Why the trainer cannot learn from ``trajectory`` (``Trajectory.untrainable_reason``, or no
    sampled token at all); None when it can."""
    reason = trajectory.untrainable_reason
    if reason is None and not any(trajectory.loss_mask):
        reason = "no sampled token (empty loss_mask)"
    return reason


def read_controller_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/controller.jsonl`` (a torn last line is skipped)."""
    path = Path(run_dir) / CONTROLLER_LOG
    records = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def trajectory_stats(trajectories: Iterable[Trajectory], policy_version: int) -> dict[str, float]:
    """``rollout/*`` and ``env/<env>/*`` metrics of the trajectories an update used."""
    items = list(trajectories)
    if not items:
        return {}
    rewards = [t.reward for t in items]
    response = [sum(t.loss_mask) for t in items]
    metrics: dict[str, float] = {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/success": statistics.fmean(float(t.success) for t in items),
        "rollout/response_length": statistics.fmean(response),
        "rollout/response_length_per_turn": sum(response) / max(sum(t.num_turns for t in items), 1),
        "rollout/turns": statistics.fmean(t.num_turns for t in items),
        "rollout/truncated": statistics.fmean(float(t.truncated) for t in items),
        "rollout/invalid_rate": sum(sum(not turn.valid for turn in t.turns) for t in items)
        / max(sum(t.num_turns for t in items), 1),
        "rollout/staleness": statistics.fmean(policy_version - t.policy_version for t in items),
        "rollout/staleness_max": float(max(policy_version - t.policy_version for t in items)),
    }
    groups: dict[str, list[float]] = {}
    for t in items:
        groups.setdefault(t.group_id, []).append(t.reward)
    metrics["rollout/in_group_std"] = statistics.fmean(
        statistics.pstdev(values) if len(values) > 1 else 0.0 for values in groups.values()
    )
    by_env: dict[str, list[Trajectory]] = {}
    for t in items:
        by_env.setdefault(t.env, []).append(t)
    for env, members in by_env.items():
        metrics[f"env/{env}/success"] = statistics.fmean(float(t.success) for t in members)
        metrics[f"env/{env}/turns"] = statistics.fmean(t.num_turns for t in members)
        metrics[f"env/{env}/reward"] = statistics.fmean(t.reward for t in members)
    timings = [t.timings.get("queue_wait_s") for t in items if "queue_wait_s" in t.timings]
    if timings:
        metrics["system/queue_wait_s"] = statistics.fmean(timings)
    return metrics
