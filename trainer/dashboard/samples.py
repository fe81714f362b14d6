"""Recent trajectories of a run as the trainer saw them: written by the trainer, read by the dashboard.

The trainer appends one record per trajectory it disposed of to ``<run_dir>/trajectories.jsonl``
(a :class:`~trainer.audit_log.RotatingJsonl`, so the file stays bounded: 16 MiB x 5 at most):

* ``kept``: trained on at update ``step``, with the per-token ``advantages`` this rank computed
  (``null`` for another rank's share under multi-process training);
* ``filtered``: a complete group the StarPO-S variance filter left out of update ``step``;
* ``dropped``: a group the controller threw away (stale, untrainable, failed), ``reason`` says why.

Each record is the wire :class:`~services.rollout_protocol.Trajectory` (turns, token ids, loss
mask, behaviour log-probs: the exact tokens the trainer used, never re-tokenised text) plus those
fields, so the dashboard's token view shows what the update saw. Floats are rounded to 4 digits,
which halves the file and is finer than any colour scale.

:class:`TrajectorySamples` reads the file back incrementally (only lines appended since the last
read are parsed) and keeps the newest ``per_env`` records of each env: the bounded ring buffer the
dashboard serves from, for a live run and for a finished one alike.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from services.rollout_protocol import Trajectory
from trainer.audit_log import DEFAULT_KEEP, DEFAULT_MAX_BYTES, RotatingJsonl, rotated_path

TRAJECTORIES_FILE = "trajectories.jsonl"
RecordStatus = Literal["kept", "filtered", "dropped"]
SUMMARY_FIELDS = (
    "job_id",
    "group_id",
    "env",
    "seed",
    "step",
    "policy_version",
    "reward",
    "success",
    "num_turns",
    "truncated",
    "error",
    "status",
    "reason",
    "recorded_at",
    "group_reward_std",
)
DEFAULT_PER_ENV = 256
"""Records kept per env by the reader: ~10 KB each for a FrozenLake episode, so a few MB per env."""


def _rounded(values: Iterable[float]) -> list[float]:
    return [round(float(value), 4) for value in values]


def trajectory_record(
    trajectory: Trajectory,
    *,
    status: RecordStatus,
    step: int | None,
    reason: str | None = None,
    group_reward_std: float | None = None,
    advantages: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The JSON record of one trajectory (see the module doc)."""
    record = trajectory.model_dump(mode="json")
    record["logprobs"] = _rounded(trajectory.logprobs)
    record |= {
        "status": status,
        "step": step,
        "reason": reason,
        "recorded_at": time.time(),
        "group_reward_std": None if group_reward_std is None else round(group_reward_std, 6),
        "advantages": None if advantages is None else _rounded(advantages),
    }
    return record


class TrajectoryRecorder:
    """Appends trajectory records to ``<run_dir>/trajectories.jsonl`` (bounded by rotation)."""

    def __init__(
        self, run_dir: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP
    ) -> None:
        self._log = RotatingJsonl(Path(run_dir) / TRAJECTORIES_FILE, max_bytes=max_bytes, keep=keep)

    def record_group(
        self,
        trajectories: Sequence[Trajectory],
        *,
        status: RecordStatus,
        step: int | None,
        reason: str | None = None,
        group_reward_std: float | None = None,
        advantages: Sequence[Sequence[float] | None] | None = None,
    ) -> None:
        """One record per trajectory; ``advantages[i]`` (one per token) belongs to ``trajectories[i]``."""
        for index, trajectory in enumerate(trajectories):
            self._log.write(
                trajectory_record(
                    trajectory,
                    status=status,
                    step=step,
                    reason=reason,
                    group_reward_std=group_reward_std,
                    advantages=None if advantages is None else advantages[index],
                )
            )

    def close(self) -> None:
        self._log.close()


@dataclass(frozen=True)
class SampleFilter:
    """What the trajectory browser asks for; None matches everything."""

    env: str | None = None
    group: str | None = None
    seed: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    success: bool | None = None
    policy_version: int | None = None
    status: RecordStatus | None = None
    error: bool | None = None

    def matches(self, record: dict[str, Any]) -> bool:
        reward = record.get("reward", 0.0)
        return (
            (self.env is None or record.get("env") == self.env)
            and (self.group is None or record.get("group_id") == self.group)
            and (self.seed is None or str(record.get("seed")) == self.seed)
            and (self.min_reward is None or reward >= self.min_reward)
            and (self.max_reward is None or reward <= self.max_reward)
            and (self.success is None or bool(record.get("success")) == self.success)
            and (self.policy_version is None or record.get("policy_version") == self.policy_version)
            and (self.status is None or record.get("status") == self.status)
            and (self.error is None or (record.get("error") is not None) == self.error)
        )


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The fields the browser lists (no turns, no tokens)."""
    return {name: record.get(name) for name in SUMMARY_FIELDS}


class TrajectorySamples:
    """The newest ``per_env`` trajectory records of each env of one run, read incrementally.

    :meth:`refresh` parses only what was appended since the previous call; when the writer
    rotated the file in between, the rest of the rotated file is read first. The first refresh
    reads the newest rotated file and the live one (at most 2 x 16 MiB), which is more than the
    ring buffer keeps for any realistic env count.
    """

    def __init__(self, run_dir: str | Path, *, per_env: int = DEFAULT_PER_ENV) -> None:
        self.path = Path(run_dir) / TRAJECTORIES_FILE
        self.per_env = per_env
        self._by_env: dict[str, deque[dict[str, Any]]] = {}
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""

    def refresh(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if self._inode is None:
            self._read(rotated_path(self.path, 1), 0)
        elif stat.st_ino != self._inode or stat.st_size < self._offset:
            self._catch_up_rotated()
            self._partial = b""
            self._offset = 0
        self._inode = stat.st_ino
        self._offset = self._read(self.path, self._offset)

    def _catch_up_rotated(self) -> None:
        """The file we were reading was rotated (maybe more than once): finish it, then read the
        files rotated after it, oldest first, before the live one is read from its start."""
        rotated = []
        for index in range(1, 64):
            path = rotated_path(self.path, index)
            try:
                inode = path.stat().st_ino
            except FileNotFoundError:
                break
            rotated.append(path)
            if inode == self._inode:
                self._read(path, self._offset)
                for newer in reversed(rotated[:-1]):
                    self._read(newer, 0)
                return

    def _read(self, path: Path, offset: int) -> int:
        """Parse the complete lines of ``path`` after ``offset``; returns the offset reached."""
        try:
            with path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            return offset
        if path == self.path:
            data, self._partial = self._partial + data, b""
            cut = data.rfind(b"\n") + 1
            self._partial = data[cut:]
            consumed = len(data) - len(self._partial)
            data = data[:cut]
        else:
            consumed = len(data)
        for line in data.splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                record = orjson.loads(line)
                if isinstance(record, dict) and isinstance(record.get("job_id"), str):
                    self._add(record)
        return offset + consumed

    def _add(self, record: dict[str, Any]) -> None:
        env = str(record.get("env"))
        ring = self._by_env.get(env)
        if ring is None:
            ring = self._by_env[env] = deque(maxlen=self.per_env)
        ring.append(record)

    @property
    def envs(self) -> list[str]:
        return sorted(self._by_env)

    def records(self) -> list[dict[str, Any]]:
        """Every kept record, newest first."""
        merged = [record for ring in self._by_env.values() for record in ring]
        merged.sort(key=lambda record: record.get("recorded_at") or 0.0, reverse=True)
        return merged

    def query(self, where: SampleFilter, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """``(matching count, the newest `limit` matching summaries)``."""
        matching = [record for record in self.records() if where.matches(record)]
        return len(matching), [summary(record) for record in matching[:limit]]

    def find(self, job_id: str) -> dict[str, Any] | None:
        """The newest record of ``job_id`` (a re-issued job may appear twice)."""
        return next((record for record in self.records() if record.get("job_id") == job_id), None)

    def group(self, group_id: str) -> list[dict[str, Any]]:
        members = [record for record in self.records() if record.get("group_id") == group_id]
        return sorted(members, key=lambda record: record.get("job_id", ""))
