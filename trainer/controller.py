"""The controller: issues rollout jobs, gathers trajectories into groups, and hands out update batches.

docs/architecture.md ("Delivery", "Training"). The controller owns the two Redis streams
on the trainer's side:

* **issuing**: each new *group* draws an env from the config's mix (by weight) and the next seed
  of the train split; its ``group_size`` jobs share env, seed and ``group_id`` and get distinct
  sampling seeds. Max turns come from the ScalingInter-RL schedule at the current update step,
  ``policy_version`` is the version being served. At most :attr:`TrainConfig.issue_limit` jobs
  are outstanding: issued and not yet disposed of (queued, being played, or delivered and waiting
  for a batch). That limit is the staleness bound, enforced where it costs nothing (admission
  control, as AReaL does): ``max_staleness + 1`` batches of candidate groups at most, so a group
  issued under version ``v`` is trained by version ``v + max_staleness`` when groups finish in
  the order they were issued (``rollout.max_inflight`` can lower it). The config guarantees the
  limit fits one batch of candidate groups (:attr:`TrainConfig.min_inflight`), so waiting for a
  batch always ends.
* **grouping**: trajectories are consumed in the ``trainer`` group and collected by ``group_id``;
  a group is *complete* when all ``group_size`` of its members arrived. A complete group with
  an untrainable member (``Trajectory.untrainable_reason``: failed episode, text-only) is dropped,
  the reason logged and counted. A group is *never* dropped for its age: dropping the groups older
  than ``max_staleness`` drops long episodes (which span more updates) more often than short ones
  and biases training toward short episodes. A batch takes the oldest complete groups first; one
  that outlasted the bound anyway (a long episode among short ones) is trained, its lag corrected
  by the PPO ratio against its recorded behaviour log-probs, and counted (``trained_stale``).
* **lost jobs**: a group not complete ``group_timeout_s`` after it was issued (a job lost with
  its worker, a poison job) has its *missing members* re-issued once, under new job ids
  (``<group>-<member>-r1``) with the same env, seed, sampling seed and max turns, so the group
  still compares one initial state; whichever copy of a member arrives first is used, a later one
  is a duplicate (counted, acked). Still incomplete ``group_timeout_s`` after that, the group is
  dropped and counted (``rollout/groups_timed_out``) and its slots are freed; members that turn up
  later are counted as ``late`` and acked, never trained on.
* **StarPO-S**: with the filter on, a batch is cut from the smallest number of complete groups whose
  ``filter_ratio`` share is ``groups_per_batch`` (so the update keeps its configured size: more
  groups are issued to refill it); the kept groups are those with the highest in-group reward std
  (``std_rev``: the lowest) and the rest are dropped. The kept ratio is reported.
* **evaluation**: :meth:`Controller.start_eval` issues a round of held-out episodes through the
  same job stream (:mod:`trainer.evaluation`); their trajectories are set apart, never trained on.
* **acknowledging**: nothing is acked when it is consumed. Every trajectory that was used, filtered
  out or dropped waits in :attr:`Controller.uncommitted` until :meth:`Controller.commit`, which
  the trainer calls right after the checkpoint of the update that used them is saved. A trainer
  that dies re-reads on restart (``XAUTOCLAIM`` from idle 0) everything it had consumed and not
  committed: no trajectory is lost, none is used twice.

Everything the controller does is appended to ``<run_dir>/controller.jsonl`` (:mod:`trainer.audit_log`:
rotated by size, a few old files kept, read back with :func:`read_controller_log`), one JSON object
a line, about a hundred bytes per job: ``start`` per lifetime, ``issue`` per group (its job ids),
``reissue`` per re-issued group, ``group`` per group received in full (its job ids, how many were
re-read after a restart), ``drop`` per dropped group, ``batch`` per update (the update step and the
job ids it trained on, in batch order), ``commit`` per checkpoint (the job ids acked), ``eval`` per
eval round. So delivery can be audited across trainer lifetimes, and any update replayed. Its own
counters and the seed cursor are the ``controller_state`` of a checkpoint
(:meth:`Controller.state_dict`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

from services.http_client import Backoff
from services.queue import Delivery, StreamQueue, job_queue, trajectory_queue
from services.rollout_protocol import JobFields, RolloutJob, RunKeys, Trajectory
from trainer.algorithms.filtering import select_groups
from trainer.audit_log import DEFAULT_KEEP, DEFAULT_MAX_BYTES, RotatingJsonl, read_jsonl
from trainer.config import TrainConfig
from trainer.dashboard.samples import TrajectoryRecorder
from trainer.evaluation import EvalRound, eval_group_prefix, make_eval_jobs, per_env_stats

logger = logging.getLogger(__name__)

CONTROLLER_LOG = "controller.jsonl"
TRAINER_CONSUMER = "trainer"
"""The trainer's consumer name in the ``trainer`` group: the same in every lifetime, so that a
restarted trainer finds its own pending entries (it reclaims them anyway, whatever the name)."""
REISSUE_SUFFIX = "-r1"
REDIS_BACKOFF_S = 0.2
REDIS_MAX_BACKOFF_S = 5.0
"""The trainer's backoff while Redis does not answer: first wait and cap, in seconds."""
_MAX_REASON_LOGS = 20
STALL_WARNING_S = 60.0
"""A batch that takes longer than this gets a warning saying why, and again each time as long."""


@dataclass
class Group:
    """The trajectories of one ``group_id`` as they arrive, with the stream entries they came from."""

    group_id: str
    env: str
    issued_at: float = field(default_factory=time.monotonic)
    """When it was issued (or re-issued; for a group of an earlier lifetime, its first arrival)."""
    template: RolloutJob | None = None
    """A job of the group, from which missing members are re-issued."""
    entries: list[Delivery[Trajectory]] = field(default_factory=list)
    members: set[int] = field(default_factory=set)
    reissued: bool = False
    reclaimed: int = 0
    completed_at: float = 0.0

    @property
    def trajectories(self) -> list[Trajectory]:
        return [delivery.model for delivery in self.entries]

    @property
    def job_ids(self) -> list[str]:
        return [delivery.model.job_id for delivery in self.entries]

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
    """What one update trains on: ``groups_per_batch`` complete, trainable groups."""

    groups: list[Group]
    kept_ratio: float
    """Share of candidate groups the StarPO-S filter kept (1.0 with the filter off)."""
    candidates: int
    """Complete groups looked at to cut this batch."""
    wait_s: float
    """How long the trainer waited for the batch."""
    filtered: list[Group] = field(default_factory=list)
    """Complete groups the StarPO-S filter left out (their entries are already disposed of)."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group.trajectories]


def member_index(job_id: str, group_id: str) -> int | None:
    """The member a job id names: ``<group>-<member>`` or a re-issue ``<group>-<member>-r1``."""
    head = job_id.removeprefix(f"{group_id}-").removesuffix(REISSUE_SUFFIX)
    return int(head) if head.isdigit() and job_id != head else None


def job_of(trajectory: Trajectory) -> RolloutJob:
    """The job a trajectory was played for (its job fields)."""
    return RolloutJob.model_validate(trajectory.model_dump(include=set(JobFields.model_fields)))


STALL_CHECK_S = 30.0
"""How long without a trajectory, jobs waiting, before the controller looks for the run's workers."""


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
        log_max_bytes: int = DEFAULT_MAX_BYTES,
        log_keep: int = DEFAULT_KEEP,
        recorder: TrajectoryRecorder | None = None,
    ) -> None:
        minimum = config.min_inflight
        if config.rollout.max_inflight is None or config.rollout.max_inflight < minimum:
            raise ValueError(
                f"rollout.max_inflight {config.rollout.max_inflight} is below the {minimum} jobs one batch "
                "of candidate groups needs: no batch could ever be cut (validate the config after changing it)"
            )
        self.config = config
        self.redis = redis
        self.consumer = consumer
        self.poll_ms = poll_ms
        self.max_inflight: int = config.issue_limit
        self.keys = RunKeys(config.run.name)
        self.jobs: StreamQueue[RolloutJob] = job_queue(redis, self.keys)
        self.trajectories: StreamQueue[Trajectory] = trajectory_queue(redis, self.keys)
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
                "trained_stale",
                "dropped_untrainable",
                "dropped_foreign",
                "duplicates",
                "groups_filtered",
                "groups_reissued",
                "groups_timed_out",
                "late",
                "reclaimed",
                "eval_jobs_issued",
            ),
            0,
        )
        # -- in memory only (what is not committed is re-read after a crash)
        self._pending: dict[str, Group] = {}
        self._ready: list[Group] = []
        self._timed_out: set[str] = set()
        self._seen: set[str] = set()
        self._uncommitted: list[Delivery[Trajectory]] = []
        self._outstanding_jobs = 0
        self._eval: EvalRound | None = None
        self._eval_prefix = eval_group_prefix(self.run_id)
        self._changed = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._reason_logs = 0
        self._last_untrainable: str | None = None  # why the last group dropped as untrainable was
        self._last_delivery = time.monotonic()
        self._last_stall_check = 0.0
        self._closed = False
        self._log: RotatingJsonl | None = None
        self.recorder = recorder
        if run_dir is not None:
            self._log = RotatingJsonl(Path(run_dir) / CONTROLLER_LOG, max_bytes=log_max_bytes, keep=log_keep)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(
        self, state: dict[str, Any] | None = None, *, step: int = 0, policy_version: int = 0
    ) -> None:
        """Restore ``state`` (a checkpoint's controller_state), re-read what a previous lifetime
        consumed and did not commit, and start issuing and consuming in the background."""
        if state:
            self.load_state_dict(state)
        self.set_progress(step, policy_version)
        rollout = self.config.rollout
        bound = (
            f"max_staleness {rollout.max_staleness}: {rollout.max_staleness + 1} batch(es) of candidates"
            if self.max_inflight == self.config.staleness_limit
            else "rollout.max_inflight"
        )
        logger.info(
            "in-flight limit %d jobs (%s; one batch needs %d candidate groups of %d)",
            self.max_inflight,
            bound,
            self.config.candidate_groups,
            rollout.group_size,
        )
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
            # Let the loop see the flag (one poll); cancelling it inside a blocking Redis read is
            # the last resort only, as redis-py's cleanup of a cancelled read can hang.
            done, _ = await asyncio.wait({self._pump_task}, timeout=self.poll_ms / 1000 + 15.0)
            if not done:
                self._pump_task.cancel()
            self._pump_task = None
        if self._log is not None:
            self._log.close()
            self._log = None

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
        # reused job id would be deduplicated away by the workers (stargym:<run>:done:<job_id>).
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
                history_turns=rollout.history_turns,
                options=env.options,
                agent=rollout.agent,
            )
            for member in range(rollout.group_size)
        ]

    async def _issue(self) -> int:
        """Publish whole groups while the in-flight limit allows; returns jobs issued."""
        group_size = self.config.rollout.group_size
        groups = max((self.max_inflight - self._outstanding_jobs) // group_size, 0)
        if groups == 0:
            return 0
        per_group = [
            self.make_group_jobs(index) for index in range(self.groups_issued, self.groups_issued + groups)
        ]
        await self.jobs.publish_many([job for members in per_group for job in members])
        self.groups_issued += groups
        self._outstanding_jobs += groups * group_size
        self.counters["jobs_issued"] += groups * group_size
        for members in per_group:
            first = members[0]
            self._pending[first.group_id] = Group(first.group_id, first.env, template=first)
            self._write(
                {
                    "event": "issue",
                    "group_id": first.group_id,
                    "env": first.env,
                    "seed": first.seed,
                    "max_turns": first.max_turns,
                    "version": first.policy_version,
                    "job_ids": [job.job_id for job in members],
                }
            )
        return groups * group_size

    async def _expire(self) -> None:
        """Re-issue the missing members of groups past ``group_timeout_s``, or drop them the second time."""
        timeout = self.config.rollout.group_timeout_s
        now = time.monotonic()
        for group in [g for g in self._pending.values() if now - g.issued_at >= timeout]:
            if not group.reissued and group.template is not None:
                jobs = self._reissue_jobs(group)
                await self.jobs.publish_many(jobs)
                group.reissued, group.issued_at = True, now
                self.counters["groups_reissued"] += 1
                self._log_reason(
                    f"group {group.group_id}: {len(jobs)} job(s) not back after {timeout:g} s; re-issued once"
                )
                self._write(
                    {"event": "reissue", "group_id": group.group_id, "job_ids": [job.job_id for job in jobs]}
                )
                continue
            del self._pending[group.group_id]
            self._timed_out.add(group.group_id)
            self.counters["groups_timed_out"] += 1
            missing = self.config.rollout.group_size - len(group.members)
            self._drop(
                group, "timed_out", f"{missing} member(s) still missing {timeout:g} s after the re-issue"
            )
            self._changed.set()

    def _reissue_jobs(self, group: Group) -> list[RolloutJob]:
        """New jobs for the members of ``group`` that have not arrived: same env, seed, sampling seed."""
        template = group.template
        assert template is not None
        first = member_index(template.job_id, group.group_id) or 0
        jobs = []
        for member in range(self.config.rollout.group_size):
            if member in group.members:
                continue
            seed = None if template.sampling.seed is None else template.sampling.seed - first + member
            jobs.append(
                template.model_copy(
                    update={
                        "job_id": f"{group.group_id}-{member}{REISSUE_SUFFIX}",
                        "sampling": template.sampling.model_copy(update={"seed": seed}),
                        "policy_version": self.policy_version,
                        "created_at": time.time(),
                    }
                )
            )
        return jobs

    async def start_eval(self, step: int) -> bool:
        """Issue an eval round for the policy of ``step``; False (nothing issued) while one is out."""
        if self._eval is not None:
            return False
        jobs = make_eval_jobs(self.config, self.run_id, self.lifetime, step, self.policy_version)
        await self.jobs.publish_many(jobs)
        self._eval = EvalRound(step, self.policy_version, jobs[0].group_id, {job.job_id for job in jobs})
        self.counters["eval_jobs_issued"] += len(jobs)
        self._write({"event": "eval", "step": step, "group_id": jobs[0].group_id, "jobs": len(jobs)})
        return True

    def finished_eval(self) -> EvalRound | None:
        """The outstanding eval round once it is complete or past ``group_timeout_s``; it is then forgotten."""
        round_ = self._eval
        if round_ is None:
            return None
        if not round_.complete and time.monotonic() - round_.issued_at < self.config.rollout.group_timeout_s:
            return None
        self._eval = None
        return round_

    async def wait_eval(self, timeout_s: float) -> EvalRound | None:
        """Wait (at most ``timeout_s``) for the outstanding eval round; None if there is none."""
        deadline = time.monotonic() + timeout_s
        while self._eval is not None:
            round_ = self.finished_eval()
            if round_ is not None:
                return round_
            if self._error is not None:
                raise RuntimeError("the controller's background loop failed") from self._error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                round_, self._eval = self._eval, None
                return round_
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
        return None

    # -- consuming ------------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Background loop: top the job queue up, read trajectories, group them, expire lost groups."""
        backoff = Backoff(REDIS_BACKOFF_S, REDIS_MAX_BACKOFF_S)
        while not self._closed:
            try:
                await self._issue()
                deliveries = await self.trajectories.consume(self.consumer, count=512, block_ms=self.poll_ms)
                for delivery in deliveries:
                    self._accept(delivery)
                if deliveries:
                    self._last_delivery = time.monotonic()
                await self._expire()
                await self._say_why_nothing_arrives()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except RedisError as exc:
                delay = backoff.next_delay()
                logger.warning(
                    "Redis error in the controller: %s: %s; retrying in %.1f s",
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
            except Exception as exc:  # a bug: make next_batch raise instead of hanging
                logger.exception("the controller stopped")
                self._error = exc
                self._changed.set()
                return

    def _accept(self, delivery: Delivery[Trajectory], reclaimed: bool = False) -> None:
        trajectory = shape_reward(delivery.model, self.config.rollout.invalid_penalty)
        delivery = Delivery(delivery.entry_id, trajectory)
        group_id = trajectory.group_id
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
        if group_id.startswith(self._eval_prefix):
            # Eval episodes are never trained on; they are acked with the next checkpoint.
            if self._eval is not None and self._eval.add(delivery.model):
                self._changed.set()
            self._uncommitted.append(delivery)
            return
        group = self._pending.get(group_id)
        if group is None and (group_id in self._timed_out or group_id.endswith(self.lifetime)):
            # The group was used or dropped already: a re-issued member's original, or too late.
            self.counters["late"] += 1
            self._uncommitted.append(delivery)
            return
        if group is None:
            # A group an earlier trainer lifetime issued: its slots are counted from now on.
            group = Group(group_id, trajectory.env, template=job_of(trajectory))
            self._pending[group_id] = group
            self._outstanding_jobs += self.config.rollout.group_size
        member = member_index(trajectory.job_id, group_id)
        if member is None:  # an id this controller did not make: a member of its own
            member = next(index for index in range(len(group.entries) + 1) if index not in group.members)
        if member in group.members:  # the original and its re-issue both came back
            self.counters["duplicates"] += 1
            self._uncommitted.append(delivery)
            return
        group.members.add(member)
        group.entries.append(delivery)
        group.reclaimed += reclaimed
        if len(group.members) >= self.config.rollout.group_size:
            del self._pending[group_id]
            group.completed_at = time.monotonic()
            self._write(
                {
                    "event": "group",
                    "group_id": group_id,
                    "job_ids": group.job_ids,
                    "reclaimed": group.reclaimed,
                }
            )
            self._complete(group)

    def _complete(self, group: Group) -> None:
        reasons = [reason for t in group.trajectories if (reason := untrainable_reason(t)) is not None]
        if reasons:
            self.counters["dropped_untrainable"] += len(group.entries)
            self._last_untrainable = reasons[0]
            self._drop(group, "untrainable", f"{len(reasons)} untrainable: {reasons[0]}")
            return
        self._ready.append(group)
        self._changed.set()

    def _drop(self, group: Group, kind: str, reason: str) -> None:
        self._log_reason(f"group {group.group_id} dropped ({kind}): {reason}")
        self._write({"event": "drop", "group_id": group.group_id, "kind": kind, "reason": reason})
        if self.recorder is not None and group.entries:
            self.recorder.record_group(
                group.trajectories,
                status="dropped",
                step=None,
                reason=f"{kind}: {reason}",
                group_reward_std=group.reward_std,
            )
        self._dispose(group)

    def _dispose(self, group: Group) -> None:
        """Hand the group's entries to the next commit and free its slots (all of them, arrived or not)."""
        self._uncommitted += group.entries
        self._outstanding_jobs = max(self._outstanding_jobs - self.config.rollout.group_size, 0)

    def _log_reason(self, message: str) -> None:
        self._reason_logs += 1
        if self._reason_logs <= _MAX_REASON_LOGS:
            logger.warning(message)
        elif self._reason_logs == _MAX_REASON_LOGS + 1:
            logger.warning(
                "further drops and stale groups are counted in rollout/dropped_* and rollout/trained_stale only"
            )

    # -- batches --------------------------------------------------------------------------------

    def _stall_reason(self, waited_s: float, untrainable: int) -> str:
        """Why no batch came for ``waited_s``: the words a user needs, not only counters.
        ``untrainable``: trajectories dropped as such while it waited."""
        waiting = f"no update batch for {waited_s:.0f} s ({len(self._ready)}/{self.config.candidate_groups} groups ready)"
        if untrainable:
            return (
                f"{waiting}: {untrainable} trajectories came back untrainable meanwhile (failed episodes), "
                f"the last because: {self._last_untrainable}. See the rollout workers' and env servers' logs"
            )
        return f"{waiting}: {self._outstanding_jobs} jobs issued and not back; are rollout workers running on this run?"

    async def next_batch(self, timeout_s: float | None = None) -> Batch:
        """Wait for enough complete groups and cut one update batch (for step ``step + 1``), the oldest first."""
        started = warned = time.monotonic()
        untrainable_before = self.counters["dropped_untrainable"]
        needed = self.config.candidate_groups
        while True:
            if self._error is not None:
                raise RuntimeError("the controller's background loop failed") from self._error
            if len(self._ready) >= needed:
                break
            if time.monotonic() - warned >= STALL_WARNING_S:
                warned = time.monotonic()
                logger.warning(
                    self._stall_reason(
                        warned - started, self.counters["dropped_untrainable"] - untrainable_before
                    )
                )
            self._changed.clear()
            remaining = None if timeout_s is None else timeout_s - (time.monotonic() - started)
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no batch within {timeout_s} s ({len(self._ready)}/{needed} groups)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining or 5.0, 5.0))
        # The oldest first (stable: in order of completion within a version), so a straggler
        # is trained as soon as it is complete and the staleness bound holds for the rest.
        self._ready.sort(key=lambda group: group.oldest_version)
        candidates, self._ready = self._ready[:needed], self._ready[needed:]
        self._count_stale(candidates)
        groups_per_batch = self.config.rollout.groups_per_batch
        flt = self.config.starpo_s.filter
        filtered: list[Group] = []
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
                    filtered.append(group)
            kept_ratio = len(kept) / len(candidates)
        else:
            kept, kept_ratio = candidates, 1.0
        for group in kept:
            self._dispose(group)
        batch = Batch(kept, kept_ratio, len(candidates), time.monotonic() - started, filtered)
        self.counters["trajectories_used"] += len(batch.trajectories)
        self._write(
            {
                "event": "batch",
                "step": self.step + 1,
                "version": self.policy_version,
                "kept_ratio": kept_ratio,
                "candidates": len(candidates),
                "job_ids": [t.job_id for t in batch.trajectories],
            }
        )
        return batch

    def _count_stale(self, groups: list[Group]) -> None:
        """Count (and say, a few times) the trajectories trained older than ``max_staleness``: an
        episode that outlasted that many updates, or engines that do not serve new policies."""
        limit = self.config.rollout.max_staleness
        for group in groups:
            lag = self.policy_version - group.oldest_version
            if lag > limit:
                self.counters["trained_stale"] += len(group.entries)
                self._log_reason(
                    f"group {group.group_id} trained {lag} versions old (max_staleness {limit}): an episode "
                    "that outlasted the others, or engines not serving new policies (see the rollout "
                    "workers' logs if rollout/staleness keeps growing)"
                )

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

    async def _say_why_nothing_arrives(self) -> None:
        """Warn, every :data:`STALL_CHECK_S` while jobs wait and no trajectory has come for as
        long, when no rollout worker serves this run, naming the runs whose workers there are: a
        worker started without ``--run`` (or with another) serves another run's queue, and the
        trainer would otherwise wait for ever without a word."""
        now = time.monotonic()
        if (
            self._outstanding_jobs == 0
            or now - self._last_delivery < STALL_CHECK_S
            or now - self._last_stall_check < STALL_CHECK_S
        ):
            return
        self._last_stall_check = now
        if await self.redis.exists(self.keys.workers):
            return
        others = sorted(
            {
                RunKeys.run_of_workers_key(key.decode(errors="replace"))
                async for key in self.redis.scan_iter(match=RunKeys.workers_pattern(), count=1000)
            }
        )
        found = (
            f"workers serve other runs: {', '.join(others)}" if others else "no worker serves any run here"
        )
        logger.warning(
            "no trajectory for %.0f s and no rollout worker serves run %r (%s): start one with "
            "`stargym rollout --run %s` (STARGYM_ROLLOUT_RUN=%s)",
            now - self._last_delivery,
            self.run_id,
            found,
            self.run_id,
            self.run_id,
        )

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
            "system/partial_groups": sum(bool(g.entries) for g in self._pending.values()),
            "system/ready_groups": len(self._ready),
        }

    def counter_metrics(self) -> dict[str, float]:
        return {f"rollout/{name}": float(value) for name, value in self.counters.items()}

    # -- log ------------------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.write({"t": round(time.time(), 3), "lifetime": self.lifetime, **record})


def shape_reward(trajectory: Trajectory, invalid_penalty: float) -> Trajectory:
    """``trajectory`` with ``invalid_penalty x (invalid turns / turns)`` added to its return.

    The plain action format has no format penalty, so a policy that never names a valid action
    gets no reward signal at all; this is the trainer's equivalent of RAGEN's format penalty. It
    is a *share* of the turns, not a count, so that ending an episode early (walking into a hole)
    never pays: an episode of valid moves gets 0 however long it is. Each invalid turn carries
    ``invalid_penalty / turns`` of it, so per-turn rewards still sum to the return.

    A turn of several actions counts as the share of them the env rejected
    (:attr:`Turn.invalid_share`): all-or-nothing, a random policy's three-word reply is almost
    never wholly valid, so every reply would earn the same penalty and teach nothing.
    """
    if invalid_penalty == 0.0 or all(turn.valid for turn in trajectory.turns):
        return trajectory
    per_turn = invalid_penalty / len(trajectory.turns)
    turns = [
        turn
        if turn.valid
        else turn.model_copy(update={"reward": turn.reward + per_turn * turn.invalid_share})
        for turn in trajectory.turns
    ]
    penalty = per_turn * sum(turn.invalid_share for turn in trajectory.turns)
    return trajectory.model_copy(update={"turns": turns, "reward": trajectory.reward + penalty})


def untrainable_reason(trajectory: Trajectory) -> str | None:
    """Why the trainer cannot learn from ``trajectory`` (``Trajectory.untrainable_reason``, or no
    sampled token at all); None when it can."""
    reason = trajectory.untrainable_reason
    if reason is None and not any(trajectory.loss_mask):
        reason = "no sampled token (empty loss_mask)"
    return reason


def read_controller_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/controller.jsonl`` and its rotated files, oldest first (torn lines skipped)."""
    return read_jsonl(Path(run_dir) / CONTROLLER_LOG)


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
    compared = [values for values in groups.values() if len(values) > 1]
    if compared:  # the groups a group-relative advantage can learn from: rewards that differ
        metrics["rollout/groups_with_signal"] = statistics.fmean(
            float(max(values) > min(values)) for values in compared
        )
    metrics |= per_env_stats(items, "env")
    timings = [t.timings.get("queue_wait_s") for t in items if "queue_wait_s" in t.timings]
    if timings:
        metrics["system/queue_wait_s"] = statistics.fmean(timings)
    return metrics
