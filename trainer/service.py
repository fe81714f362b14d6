"""The trainer service: the training loop of a run and its HTTP API on :8300.

One asyncio loop runs everything (issue 4, items 4, 6 and 7):

* the :class:`~trainer.controller.Controller` issues jobs and assembles batches in the background;
* each update runs :class:`trainer.update.PolicyUpdater` in a worker thread (the loop keeps issuing
  jobs, reading trajectories and answering HTTP meanwhile);
* after each update the new policy is published as ``policy-v<step>`` and ``stargym:<run>:policy`` is
  pointed at it, so rollout workers reload it between episodes;
* every ``save_every`` updates (and at the end) a checkpoint is saved (policy, optimiser/scheduler/
  critic via the updater's state, RNG, curriculum, controller and echo-trap state), and only then
  are the trajectories used since the previous checkpoint acked;
* metrics go to ``<run_dir>/metrics.jsonl`` and to ``/metrics`` (Prometheus gauges of the latest
  values); echo-trap events are logged as warnings and counted in ``train/echo_trap/*``;
* a run resumes from its newest checkpoint: the step continues, the published policy is restored,
  and the trajectories the dead trainer had not committed are re-read;
* a Redis outage (a restart, a failover) is waited out: the controller backs off its reads, and
  the writes an update must make (the policy pointer, the acks after a checkpoint, an eval
  round's jobs) are retried with backoff until Redis answers or the run is stopped;
* every ``eval.every`` updates, and once more when the run ends (total steps or time budget, not
  on a stop), the held-out seeds are played (:mod:`trainer.evaluation`) while training goes on;
  each finished round's ``eval/*`` metrics are logged at the step whose policy it played, and
  appended to ``<run_dir>/eval.jsonl``. The end-of-run round is waited for (at most
  ``rollout.group_timeout_s``) after the final checkpoint. A round that reaches
  ``eval.stop_at_success`` ends the run as ``total_steps`` would.

Run as N processes (``stargym train --nproc-per-node N``, :mod:`trainer.ranks`), this service is
rank 0: it hands each rank its share of every batch, and the other ranks run :func:`follow_leader`.

Routes: ``GET /health``, ``GET /metrics``, ``GET /status`` (:class:`TrainerStatus`), and with
``dashboard.enabled`` the dashboard (``/``, ``/api/*``; :mod:`trainer.dashboard`). For it the
trainer also writes ``<run_dir>/status.json`` at every state change and update, and the
trajectories each update used or filtered out to ``trajectories.jsonl`` (the controller adds the
groups it drops).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field
from redis.asyncio import Redis

from services.http_app import create_app
from services.http_client import Backoff
from services.queue import connect, retry_unreachable, set_policy
from services.rollout_protocol import RunKeys, Trajectory
from services.serving import uvicorn_options
from services.settings import ServiceSettings
from trainer.algorithms.echo_trap import EchoTrapDetector
from trainer.checkpoint import CheckpointStore, LoadedCheckpoint
from trainer.config import TrainConfig
from trainer.controller import REDIS_BACKOFF_S, REDIS_MAX_BACKOFF_S, Batch, Controller, trajectory_stats
from trainer.dashboard.app import install_dashboard
from trainer.dashboard.runs import RunsDirectory, RunStatus, write_run_status
from trainer.dashboard.samples import TrajectoryRecorder
from trainer.dashboard.system import SystemProbe
from trainer.dashboard.tokens import TokenTexts
from trainer.evaluation import EvalRound
from trainer.heap import release_free_heap
from trainer.metrics import MetricsLogger, register_prometheus
from trainer.ranks import DEFAULT_TIMEOUT_S, Leader, RankInfo, follow, split_groups

logger = logging.getLogger(__name__)
T = TypeVar("T")

EVAL_FILE = "eval.jsonl"
STATUS_KEYS = (
    "rollout/reward_mean",
    "rollout/success",
    "rollout/turns",
    "rollout/invalid_rate",
    "rollout/kept_ratio",
    "eval/success",
    "train/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "system/step_time_s",
)


class TrainerSettings(ServiceSettings):
    """Where the trainer listens and which Redis it uses (``STARGYM_*``, ``REDIS_URL``)."""

    port: int = 8300
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", validation_alias="REDIS_URL")


class TrainerStatus(BaseModel):
    """What ``GET /status`` answers."""

    run: str
    run_dir: str
    state: str = Field(description="starting | training | saving | evaluating | done | stopped | failed")
    step: int
    total_steps: int
    policy_version: int
    max_turns: int
    horizon_stage: int
    resumed_from: int | None
    last_checkpoint: int | None
    uncommitted_trajectories: int
    elapsed_s: float
    metrics: dict[str, float] = Field(description="Latest values of the main metrics.")
    counters: dict[str, int]
    error: str | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class TrainingState:
    """What every rank trains: the tokenizer, the updater (which owns the policy) and, on a resume,
    the checkpoint it was restored from."""

    tokenizer: Any
    updater: Any
    pad_token_id: int
    checkpoint: LoadedCheckpoint | None


def load_training_state(config: TrainConfig, device: torch.device, store: CheckpointStore) -> TrainingState:
    """Load the policy, wrap it in a :class:`~trainer.update.PolicyUpdater` and restore the newest
    checkpoint of the run, if any. Under torch.distributed every rank calls it (the updater's
    loading methods are collectives there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.update import PolicyUpdater

    model_dir = Path(config.model.path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path {str(model_dir)!r} is not a Hugging Face model directory "
            "(run `stargym model init`, or set model.init_tiny_if_missing and use `stargym train`)"
        )
    latest = store.latest()
    if latest is None:
        seed_everything(config.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    updater = PolicyUpdater(model, config, device=device)
    loaded = None
    if latest is not None:
        loaded = store.load(latest, **updater.checkpoint_parts(for_loading=True))
        updater.load_policy_weights(str(loaded.policy_dir))
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id or 0
    return TrainingState(tokenizer, updater, pad_token_id, loaded)


def follow_leader(config: TrainConfig, device: torch.device) -> None:
    """A rank other than 0: load what rank 0 loads, then take part in its updates and saves."""
    from trainer.batch import collate

    state = load_training_state(config, device, CheckpointStore(config.run_dir, read_only=True))
    updater = state.updater

    def checkpoint() -> None:
        updater.checkpoint_parts()
        updater.gathered_policy()

    def update(share: list[Any]) -> None:
        updater.update(collate(share, state.pad_token_id))
        release_free_heap()

    follow(
        device,
        update=update,
        publish=updater.gathered_policy,
        checkpoint=checkpoint,
    )


class Trainer:
    """One run: load or resume, then update until ``total_steps`` (or ``max_minutes``, or :meth:`stop`).

    ``ranks``: this process's place among the trainer's processes (default: the only one); with
    more than one, the others must be running :func:`follow_leader`.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        redis_url: str,
        max_minutes: float | None = None,
        device: str | None = None,
        ranks: RankInfo | None = None,
        heartbeat_s: float = DEFAULT_TIMEOUT_S / 4,
    ) -> None:
        self.config = config
        self.redis_url = redis_url
        self.max_minutes = max_minutes
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.ranks = ranks or RankInfo(rank=0, world_size=1, local_rank=0)
        if self.ranks.world_size > config.rollout.groups_per_batch:
            raise ValueError(
                f"rollout.groups_per_batch ({config.rollout.groups_per_batch}) must be at least the number "
                f"of trainer processes ({self.ranks.world_size}): each rank trains on whole groups"
            )
        self.leader = Leader(self.ranks, self.device)
        self.heartbeat_s = heartbeat_s
        self._released = False
        self.run_dir = config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.schedule = config.curriculum.schedule
        self._started_at = time.time()
        self._state = "starting"
        self.step = 0
        self.policy_version = 0
        self.resumed_from: int | None = None
        self.last_checkpoint: int | None = None
        self.error: str | None = None
        self.store = CheckpointStore(
            self.run_dir, keep_last=config.checkpoint.keep_last, keep_policies=config.checkpoint.keep_policies
        )
        # Made here so /metrics can expose it from the start; a resumed run drops the lines the
        # dead trainer logged after its last checkpoint (they are about to be redone).
        self.metrics = MetricsLogger.from_config(config, resume_step=self.store.latest())
        self.controller: Controller | None = None
        self.detector = EchoTrapDetector()
        self.echo_counts = {"collapse": 0, "grad_spike": 0, "no_signal": 0}
        self.recorder = TrajectoryRecorder(self.run_dir)
        self._trained_share: list[Trajectory] = []
        self._stop = asyncio.Event()
        self._target_reached = False
        self._started = time.monotonic()
        self._last_step_end: float | None = None

    # -- status --------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        self._write_run_status()

    def _write_run_status(self) -> None:
        """``<run_dir>/status.json``: what the runs list shows of this run, also once it has ended."""
        write_run_status(
            self.run_dir,
            RunStatus(
                run=self.config.run.name,
                state=self._state,
                step=self.step,
                total_steps=self.config.optim.total_steps,
                started_at=self._started_at,
                updated_at=time.time(),
                error=self.error,
            ),
        )

    def status(self) -> TrainerStatus:
        latest = self.metrics.snapshot()[1]
        return TrainerStatus(
            run=self.config.run.name,
            run_dir=str(self.run_dir),
            state=self.state,
            step=self.step,
            total_steps=self.config.optim.total_steps,
            policy_version=self.policy_version,
            max_turns=self.schedule.max_turns(self.step),
            horizon_stage=self.schedule.stage(self.step),
            resumed_from=self.resumed_from,
            last_checkpoint=self.last_checkpoint,
            uncommitted_trajectories=self.controller.uncommitted if self.controller else 0,
            elapsed_s=time.monotonic() - self._started,
            metrics={key: latest[key] for key in STATUS_KEYS if key in latest}
            | {key: value for key, value in latest.items() if key.startswith("env/")},
            counters=dict(self.controller.counters) if self.controller else {},
            error=self.error,
        )

    def stop(self) -> None:
        """Finish the current update, save a checkpoint, and return from :meth:`run`."""
        self._stop.set()

    # -- the run -------------------------------------------------------------------------------

    def _load(self) -> None:
        state = load_training_state(self.config, self.device, self.store)
        self.tokenizer, self.updater, self.pad_token_id = state.tokenizer, state.updater, state.pad_token_id
        self.controller_state: dict[str, Any] = {}
        loaded = state.checkpoint
        if loaded is not None:
            self.step = loaded.step
            self.resumed_from = loaded.step
            self.last_checkpoint = loaded.step
            self.controller_state = loaded.controller_state
            echo = loaded.extra.get("echo_trap")
            if echo:
                self.detector.load_state_dict(echo)
            self.echo_counts.update(loaded.extra.get("echo_counts", {}))
            logger.info("resumed run %s from its checkpoint of step %d", self.config.run.name, loaded.step)
        self.policy_version = self.step
        (self.run_dir / "config.yaml").write_text(self.config.to_yaml())

    async def run(self) -> None:
        """Train; the state ends as ``done`` (total steps or time budget), ``stopped`` or ``failed``."""
        redis = None
        try:
            await asyncio.to_thread(self._load)
            config = self.config
            redis = connect(self.redis_url)
            await self._publish(self.step, redis)
            self.controller = Controller(config, redis, run_dir=self.run_dir, recorder=self.recorder)
            await self.controller.start(
                self.controller_state, step=self.step, policy_version=self.policy_version
            )
            self.state = "training"
            deadline = None if self.max_minutes is None else self._started + 60.0 * self.max_minutes
            logger.info(
                "training run %s from step %d to %d (max turns %d)",
                config.run.name,
                self.step,
                config.optim.total_steps,
                self.schedule.max_turns(self.step),
            )
            while (
                self.step < config.optim.total_steps and not self._stop.is_set() and not self._target_reached
            ):
                if deadline is not None and time.monotonic() >= deadline:
                    logger.info("time budget of %.1f min reached at step %d", self.max_minutes, self.step)
                    break
                batch = await self._next_batch()
                if batch is None:
                    break
                await self._train_step(batch)
                await self._evaluate_between_updates()
            if self.last_checkpoint != self.step:
                await self._checkpoint()
            await self._release_followers()  # the end-of-run eval may outlast their collective timeout
            stopped = self._stop.is_set() and self.step < config.optim.total_steps
            if not stopped:
                await self._evaluate_at_the_end()
            self.state = "stopped" if stopped else "done"
            logger.info("run %s %s at step %d", config.run.name, self.state, self.step)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as exc:
            self.state = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("training failed")
            raise
        finally:
            with contextlib.suppress(Exception):
                await self._release_followers()
            if self.controller is not None:
                await self.controller.close()
            if redis is not None:
                with contextlib.suppress(Exception):
                    await redis.aclose()
            self.metrics.close()
            self.recorder.close()
            self._write_run_status()

    async def _release_followers(self) -> None:
        """Tell the other ranks the run is over (once)."""
        if self.ranks.distributed and not self._released:
            self._released = True
            await asyncio.to_thread(self.leader.command, "stop")

    async def _next_batch(self) -> Batch | None:
        """The next batch, or None once :meth:`stop` is called.

        While it waits, the other ranks are told to keep waiting every ``heartbeat_s``: they sit in
        a collective whose timeout would otherwise end them during a long rollout.
        """
        assert self.controller is not None
        heartbeat = self._keep_followers_waiting if self.ranks.distributed else None
        return await self._unless_stopped(self.controller.next_batch(), heartbeat)

    async def _keep_followers_waiting(self) -> None:
        await asyncio.to_thread(self.leader.command, "wait")

    async def _train_step(self, batch: Batch) -> None:
        assert self.controller is not None and self.metrics is not None
        step_started = self._last_step_end or (time.monotonic() - batch.wait_s)
        trajectories = batch.trajectories
        update_started = time.monotonic()
        train_metrics = await asyncio.to_thread(self._update, batch)
        update_s = time.monotonic() - update_started
        previous_step = self.step
        self.step += 1
        publish_started = time.monotonic()
        await self._publish(self.step, self.controller.redis)
        publish_s = time.monotonic() - publish_started
        self.controller.set_progress(self.step, self.policy_version)
        now = time.monotonic()
        step_time = now - step_started
        self._last_step_end = now

        metrics: dict[str, float] = {}
        for key, value in train_metrics.items():
            metrics[key if "/" in key else f"train/{key}"] = float(value)
        metrics |= trajectory_stats(trajectories, previous_step)
        metrics["rollout/kept_ratio"] = batch.kept_ratio
        metrics["rollout/candidate_groups"] = float(batch.candidates)
        for key in list(metrics):
            if key.endswith("logprob_gap") and not key.startswith("rollout/"):
                metrics["rollout/logprob_gap"] = metrics[key]
        metrics |= self.controller.counter_metrics()
        sampled = sum(sum(t.loss_mask) for t in trajectories)
        metrics |= {
            "system/step_time_s": step_time,
            "system/update_s": update_s,
            "system/publish_s": publish_s,
            "system/batch_wait_s": batch.wait_s,
            "system/tokens_per_s": sampled / max(step_time, 1e-9),
            "system/episodes_per_s": len(trajectories) / max(step_time, 1e-9),
            "system/update_tokens_per_s": sum(len(t.token_ids) for t in trajectories) / max(update_s, 1e-9),
        }
        with contextlib.suppress(Exception):
            metrics |= await self.controller.queue_metrics()
        metrics["train/horizon_max_turns"] = float(self.schedule.max_turns(self.step))
        metrics["train/horizon_stage"] = float(self.schedule.stage(self.step))
        for change in self.schedule.changes_between(previous_step, self.step):
            logger.info(change.message)
            metrics["train/horizon_stage_change"] = 1.0
        events = self.detector.update(
            self.step,
            reward_std=metrics.get("rollout/in_group_std", 0.0),
            entropy=metrics.get("train/entropy", float("nan")),
            grad_norm=metrics.get("train/grad_norm"),
            response_length=metrics.get("rollout/response_length"),
            groups_with_signal=metrics.get("rollout/groups_with_signal"),
            reward_mean=metrics.get("rollout/reward_mean"),
        )
        for event in events:
            logger.warning("step %d: %s", self.step, event.message)
            self.echo_counts[event.kind] = self.echo_counts.get(event.kind, 0) + 1
            metrics[f"train/echo_trap/{event.kind}_event"] = 1.0
            with (self.run_dir / "echo_trap.jsonl").open("a") as handle:
                handle.write(json.dumps(event.to_dict()) + "\n")
        for kind, count in self.echo_counts.items():
            metrics[f"train/echo_trap/{kind}"] = float(count)
        metrics = {key: value for key, value in metrics.items() if value is not None}
        self.metrics.log(self.step, metrics)
        self._record_batch(batch)
        self._write_run_status()
        logger.info(
            "step %d: reward %.3f success %.3f turns %.2f kept %.2f update %.2fs step %.2fs",
            self.step,
            metrics.get("rollout/reward_mean", math.nan),
            metrics.get("rollout/success", math.nan),
            metrics.get("rollout/turns", math.nan),
            batch.kept_ratio,
            update_s,
            step_time,
        )
        if self.step % self.config.checkpoint.save_every == 0:
            await self._checkpoint()

    async def _evaluate_between_updates(self) -> None:
        """Log a finished eval round; start one every ``eval.every`` updates (unless one is out)."""
        assert self.controller is not None
        finished = self.controller.finished_eval()
        if finished is not None:
            self._log_eval(finished)
            self._target_reached = self._reaches_target(finished)
            if self._target_reached:
                return
        every = self.config.eval.every
        if not every or self.step % every:
            return
        controller, step = self.controller, self.step
        if not await self._redis(
            f"issuing the eval round of step {step}", lambda: controller.start_eval(step)
        ):
            logger.warning("step %d: no eval round started, the previous one is still being played", step)

    async def _evaluate_at_the_end(self) -> None:
        """Evaluate the final policy (waiting out a round still in flight first), then ack the episodes.

        A stop (SIGTERM) ends the wait: the round may take up to ``group_timeout_s`` (30 min by
        default) when no worker plays it, and the checkpoint is already saved.
        """
        assert self.controller is not None
        previous_state, self.state = self.state, "evaluating"
        timeout = self.config.rollout.group_timeout_s
        pending = await self._unless_stopped(self.controller.wait_eval(timeout))
        if pending is not None:
            self._log_eval(pending)
        controller, step = self.controller, self.step
        if not self._stop.is_set() and (pending is None or pending.step != step):
            await self._redis(f"issuing the eval round of step {step}", lambda: controller.start_eval(step))
            final = await self._unless_stopped(controller.wait_eval(timeout))
            if final is not None:
                self._log_eval(final)
        if self._stop.is_set():
            logger.warning("step %d: the end-of-run evaluation was abandoned, the trainer was stopped", step)
        await self._redis(f"acking what step {step} used", lambda: controller.commit(step))
        self.state = previous_state

    async def _unless_stopped(
        self, waiting: Awaitable[T], heartbeat: Callable[[], Awaitable[None]] | None = None
    ) -> T | None:
        """``await waiting``, or None as soon as :meth:`stop` is called (``waiting`` is cancelled).

        ``heartbeat``, when given, is awaited every ``heartbeat_s`` that passes without either.
        """
        wait = asyncio.ensure_future(waiting)
        stop = asyncio.create_task(self._stop.wait())
        interval = self.heartbeat_s if heartbeat is not None else None
        while True:
            done, _ = await asyncio.wait({wait, stop}, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            if done:
                break
            assert heartbeat is not None  # without one, the wait above has no timeout
            await heartbeat()
        stop.cancel()
        if wait in done:
            return wait.result()
        wait.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await wait
        return None

    def _reaches_target(self, round_: EvalRound) -> bool:
        """Whether a finished round, all of its episodes played, reached ``eval.stop_at_success``."""
        target = self.config.eval.stop_at_success
        record = round_.record()
        if target is None or record["eval/missing"] or record.get("eval/success", 0.0) < target:
            return False
        logger.info(
            "eval of step %d reached eval.stop_at_success %.3f at step %d: the run ends",
            round_.step,
            target,
            self.step,
        )
        return True

    def _log_eval(self, round_: EvalRound) -> None:
        record = round_.record()
        metrics = {key: value for key, value in record.items() if key.startswith("eval/")}
        self.metrics.log(round_.step, metrics)
        with (self.run_dir / EVAL_FILE).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        logger.info(
            "eval of step %d: success %.3f, reward %.3f over %d held-out episodes (%d missing)",
            round_.step,
            record.get("eval/success", math.nan),
            record.get("eval/reward", math.nan),
            int(record["eval/episodes"]),
            int(record["eval/missing"]),
        )

    def _update(self, batch: Batch) -> dict[str, float]:
        """Every rank updates on its share of whole groups (this rank's is the first)."""
        from trainer.batch import collate

        shares = split_groups([group.trajectories for group in batch.groups], self.ranks.world_size)
        self.leader.command("batch")
        share = self.leader.scatter(shares)
        self._trained_share = share
        metrics = self.updater.update(collate(share, self.pad_token_id))
        release_free_heap()  # the update's tensors are freed now (trainer/heap.py)
        return metrics

    def _record_batch(self, batch: Batch) -> None:
        """Hand the batch to the dashboard's trajectory log: kept groups with the advantages this
        rank applied to them (None for another rank's share), filtered groups without."""
        advantages: dict[str, list[float]] = {}
        rows = self.updater.last_advantages
        if rows is not None:
            row = 0
            for trajectory in self._trained_share:  # collate's rows: one per sequence, in order
                values: list[float] = []
                for start, end in itertools.pairwise([0, *trajectory.segments, len(trajectory.token_ids)]):
                    values += rows[row, : end - start].tolist()
                    row += 1
                advantages[trajectory.job_id] = values
        for group in batch.groups:
            members = group.trajectories
            self.recorder.record_group(
                members,
                status="kept",
                step=self.step,
                group_reward_std=group.reward_std,
                advantages=[advantages.get(t.job_id) for t in members],
            )
        for group in batch.filtered:
            self.recorder.record_group(
                group.trajectories, status="filtered", step=self.step, group_reward_std=group.reward_std
            )

    def _save_policy(self, version: int) -> Path:
        self.leader.command("publish")
        return self.store.publish_policy(version, self.updater.gathered_policy(), self.tokenizer)

    async def _publish(self, version: int, redis: Redis) -> None:
        """Write ``policy-v<version>`` and point the workers at it, on the run's Redis client.

        Not a client of its own per publish: each would open a connection and look the Redis host
        up again, and under podman-compose a name lookup fails for seconds whenever a container
        joins the network (seen here: the trainer died on its first publish after a start).
        """
        path = await asyncio.to_thread(self._save_policy, version)
        keys = RunKeys(self.config.run.name)
        await self._redis(
            f"publishing policy v{version}", lambda: set_policy(redis, keys, version, str(path))
        )
        self.policy_version = version

    async def _redis(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, waiting out a Redis outage (a restart, a failover) until the run is stopped:
        the update it follows is done, and failing the run over a write it can repeat would
        throw that away (:func:`services.queue.retry_unreachable`)."""
        backoff = Backoff(REDIS_BACKOFF_S, REDIS_MAX_BACKOFF_S)
        return await retry_unreachable(call, what, backoff, self._stop)

    async def _checkpoint(self) -> None:
        """Save the checkpoint of the current step, then ack what its updates used."""
        assert self.controller is not None
        previous_state = self.state
        self.state = "saving"
        controller_state = self.controller.state_dict()
        extra = {
            "echo_trap": self.detector.state_dict(),
            "echo_counts": dict(self.echo_counts),
            "policy_version": self.policy_version,
        }
        curriculum = {
            "schedule": self.schedule.to_config(),
            "stage": self.schedule.stage(self.step),
            "max_turns": self.schedule.max_turns(self.step),
        }

        def save() -> None:
            self.leader.command("checkpoint")
            parts = self.updater.checkpoint_parts()
            policy = self.updater.gathered_policy()
            self.store.save(
                self.step,
                policy,
                self.tokenizer,
                **parts,
                curriculum_state=curriculum,
                controller_state=controller_state,
                extra=extra,
            )

        await asyncio.to_thread(save)
        self.last_checkpoint = self.step
        controller, step = self.controller, self.step
        acked = await self._redis(f"acking what step {step} used", lambda: controller.commit(step))
        logger.info("checkpoint of step %d saved; %d trajectories acked", self.step, acked)
        self.state = previous_state


def build_app(
    trainer: Trainer, settings: TrainerSettings, on_finished: Callable[[], None] | None = None
) -> FastAPI:
    """The trainer's app; the run starts with the app, and ``on_finished`` is called when it ends."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(trainer.run(), name="trainer")

        def finished(done: asyncio.Task[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                logger.error("the trainer stopped with an error: %s", done.exception())
            if on_finished is not None:
                on_finished()

        task.add_done_callback(finished)
        app.state.task = task
        try:
            yield
        finally:
            trainer.stop()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
            if probe is not None:
                await probe.aclose()

    app = create_app(
        "trainer",
        settings,
        description="Trainer: jobs out, trajectories in, policies out.",
        lifespan=lifespan,
    )
    app.state.trainer = trainer

    register_prometheus(trainer.metrics, app.state.metrics_registry)
    probe = install_trainer_dashboard(app, trainer, settings) if trainer.config.dashboard.enabled else None

    @app.get("/status", response_model=TrainerStatus, tags=["trainer"])
    async def status(request: Request) -> TrainerStatus:
        """Step, policy version, horizon, the main metrics and the controller's counters."""
        return request.app.state.trainer.status()

    return app


def install_trainer_dashboard(app: FastAPI, trainer: Trainer, settings: TrainerSettings) -> SystemProbe:
    """The dashboard at ``/``: this run live, the other runs of its parent directory finished.
    Returns the system view's probe, for the app to close when it stops."""
    token = settings.api_token.get_secret_value() if settings.api_token is not None else None
    envs = trainer.config.envs
    servers = {env.family: envs.url_for(env.id) for env in envs.mix}
    probe = SystemProbe(
        redis_url=trainer.redis_url, env_servers=servers, api_token=token, run_id=trainer.config.run.name
    )

    async def system() -> dict[str, Any]:
        snapshot = (await probe.snapshot()).model_dump(mode="json")
        return snapshot | {"trainer": trainer.status().model_dump(mode="json")}

    runs = RunsDirectory(
        trainer.run_dir.parent, live_run=trainer.run_dir.name, live_state=lambda: trainer.state
    )
    install_dashboard(app, runs, texts=TokenTexts(), system=system)
    return probe


def serve(trainer: Trainer, settings: TrainerSettings, *, keep_serving: bool = False) -> int:
    """Run the trainer with its HTTP API until the run ends or SIGTERM/SIGINT; returns an exit code.

    ``keep_serving``: a run that ends ``done`` or ``stopped`` leaves the API and dashboard up until
    SIGTERM/SIGINT. In a container the trainer is the dashboard's only server, and an orchestrator
    restarts a process that exits (Kubernetes always does): without it a finished run would take
    its dashboard with it, or be restarted to evaluate again. A failed run still exits (code 1), so
    the restart policy resumes it from its newest checkpoint.
    """
    import uvicorn

    server: uvicorn.Server | None = None

    def finished() -> None:
        if server is not None and not (keep_serving and trainer.state != "failed"):
            server.should_exit = True

    app = build_app(trainer, settings, finished)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", **uvicorn_options(settings)))
    server.run()
    if trainer.state == "failed":
        return 1
    return 0
