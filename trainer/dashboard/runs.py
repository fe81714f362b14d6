"""The runs of a runs directory, read for the dashboard from the files each run directory holds.

A run is a sub-directory with a ``config.yaml`` or a ``metrics.jsonl`` (trainer/checkpoint.py
lists the layout). Names are looked up, never joined blindly: a name must be a plain directory
name of the runs directory (the run-name pattern of the config), so ``../`` or a symlink out of
the directory is a 404, not a file read.

Metrics are read incrementally (:class:`MetricsSeries`: only the bytes appended since the
previous read are parsed, column by column), so a page polling a live run every 2 s costs the
trainer a few appended lines, not a re-read of the file; long series are downsampled here
(:func:`downsample`) so that 10,000 steps reach the browser as at most ``max_points`` points.
"""

from __future__ import annotations

import bisect
import contextlib
import fnmatch
import itertools
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field

from services.errors import not_found
from trainer.dashboard.samples import TrajectorySamples
from trainer.metrics import METRICS_FILE, parse_metrics_line

STATUS_FILE = "status.json"
ECHO_TRAP_FILE = "echo_trap.jsonl"
CONFIG_FILE = "config.yaml"
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ACTIVE_STATES = frozenset({"starting", "training", "saving", "evaluating"})
STALE_AFTER_S = 900.0
"""A run whose status file says it is active but has not changed for this long is shown as
``stale`` (its trainer died without writing a final state). Steps of big models on a GPU take
minutes, so this is generous."""
DEFAULT_MAX_POINTS = 1000


class RunStatus(BaseModel):
    """``<run_dir>/status.json``: the trainer's state, rewritten at every change and every update."""

    model_config = ConfigDict(extra="forbid")

    run: str
    state: str
    step: int = Field(ge=0)
    total_steps: int = Field(ge=0)
    started_at: float
    updated_at: float
    error: str | None = None


def write_run_status(run_dir: Path, status: RunStatus) -> None:
    """Atomically (temp file + rename): a reader never sees half a file."""
    fd, temp = tempfile.mkstemp(prefix=f".{STATUS_FILE}.tmp-", dir=run_dir)
    with os.fdopen(fd, "wb") as handle:
        handle.write(orjson.dumps(status.model_dump()))
    os.replace(temp, run_dir / STATUS_FILE)


def read_run_status(run_dir: Path) -> RunStatus | None:
    try:
        return RunStatus.model_validate_json((run_dir / STATUS_FILE).read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def downsample(
    steps: list[int], times: list[float], values: list[float | None], max_points: int
) -> tuple[list[int], list[float], list[float | None]]:
    """At most ``max_points`` points: consecutive buckets of equal size, each drawn at its last step
    and time with the mean of its finite values (None when it has none). The last point is the
    last value itself, so a live chart's newest point is exact."""
    n = len(steps)
    if n <= max_points:
        return steps, times, values
    buckets = max(max_points - 1, 1)
    edges = np.linspace(0, n - 1, buckets + 1).astype(int)
    array = np.array([math.nan if v is None else v for v in values[:-1]], dtype=float)
    out_steps, out_times, out_values = [], [], []
    for start, end in itertools.pairwise(edges):
        end = max(end, start + 1)
        chunk = array[start:end]
        finite = chunk[np.isfinite(chunk)]
        out_steps.append(steps[end - 1])
        out_times.append(times[end - 1])
        out_values.append(float(finite.mean()) if finite.size else None)
    out_steps.append(steps[-1])
    out_times.append(times[-1])
    out_values.append(values[-1])
    return out_steps, out_times, out_values


@dataclass
class _Column:
    """One key's points in step order; ``rows`` numbers the record each came from (the cursor)."""

    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def add(self, step: int, when: float, value: float | None, row: int) -> None:
        # Eval rounds are logged at the (earlier) step whose policy they played: insert in order.
        at = (
            len(self.steps)
            if not self.steps or step >= self.steps[-1]
            else bisect.bisect_right(self.steps, step)
        )
        self.steps.insert(at, step)
        self.times.insert(at, when)
        self.values.insert(at, value)
        self.rows.insert(at, row)


class MetricsSeries:
    """The columns of one run's ``metrics.jsonl``, appended to as the file grows.

    ``cursor`` counts the records read; a live page asks for what came after the cursor it was
    last given, which also brings eval points logged late at an earlier step. A file that shrank
    or was replaced (a resumed run truncates the lines it is about to redo) is read again from
    the start, and the cursor goes back, which tells the page to reload.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / METRICS_FILE
        self._identity: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self._columns: dict[str, _Column] = {}
        self._offset = 0
        self.cursor = 0
        self.last_step = 0
        self.last_time: float | None = None
        self.first_time: float | None = None

    def refresh(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        identity = (stat.st_dev, stat.st_ino)
        if identity != self._identity or stat.st_size < self._offset:
            self._reset()
            self._identity = identity
        if stat.st_size == self._offset:
            return
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        for line in complete.splitlines():
            record = parse_metrics_line(line)
            if record is not None:
                self._add(record)

    def _add(self, record: dict[str, Any]) -> None:
        self.cursor += 1
        step = record["step"]
        when = float(record.get("time") or 0.0)
        self.last_step = max(self.last_step, step)
        self.last_time = when if self.last_time is None else max(self.last_time, when)
        self.first_time = when if self.first_time is None else min(self.first_time, when)
        for key, value in record.items():
            if key in ("step", "time") or not (value is None or isinstance(value, int | float)):
                continue
            column = self._columns.get(key)
            if column is None:
                column = self._columns[key] = _Column()
            column.add(step, when, None if value is None else float(value), self.cursor)

    @property
    def keys(self) -> list[str]:
        return sorted(self._columns)

    def last(self, key: str) -> float | None:
        column = self._columns.get(key)
        if column is None:
            return None
        return next((value for value in reversed(column.values) if value is not None), None)

    def matching(self, patterns: list[str]) -> list[str]:
        """Concrete keys for ``patterns``; ``*`` matches any run of characters, ``/`` included."""
        keys: list[str] = []
        for pattern in patterns:
            found = fnmatch.filter(self._columns, pattern) if "*" in pattern else [pattern]
            keys += [key for key in sorted(found) if key in self._columns and key not in keys]
        return keys

    def series(self, keys: list[str], max_points: int, after: int | None) -> dict[str, dict[str, Any]]:
        """Each key's points in step order: those of records after cursor ``after`` in full, else
        all of them downsampled. Times are rounded to 10 ms (a third of the bytes of full floats)."""
        out: dict[str, dict[str, Any]] = {}
        for key in keys:
            column = self._columns[key]
            steps, times, values = column.steps, column.times, column.values
            if after is not None:
                picked = [i for i, row in enumerate(column.rows) if row > after]
                steps = [steps[i] for i in picked]
                times = [times[i] for i in picked]
                values = [values[i] for i in picked]
            downsampled = after is None and len(steps) > max_points
            if downsampled:
                steps, times, values = downsample(steps, times, values, max_points)
            times = [round(t, 2) for t in times]
            out[key] = {"step": steps, "time": times, "value": values, "downsampled": downsampled}
        return out


class RunReader:
    """What the dashboard reads of one run directory; files are re-read only when they changed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.name = run_dir.name
        self.metrics = MetricsSeries(run_dir)
        self.samples = TrajectorySamples(run_dir)
        self._config: tuple[float, dict[str, Any], str] | None = None

    def config_text(self) -> str:
        return self._load_config()[1]

    def config(self) -> dict[str, Any]:
        return self._load_config()[0]

    def _load_config(self) -> tuple[dict[str, Any], str]:
        path = self.run_dir / CONFIG_FILE
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return {}, ""
        if self._config is None or self._config[0] != mtime:
            text = path.read_text(encoding="utf-8")
            try:
                parsed = yaml.safe_load(text)
            except yaml.YAMLError:
                parsed = None
            self._config = (mtime, parsed if isinstance(parsed, dict) else {}, text)
        return self._config[1], self._config[2]

    def events(self) -> dict[str, list[dict[str, Any]]]:
        """ScalingInter-RL stage starts (from the config's horizon schedule) and echo-trap events."""
        schedule = self.config().get("curriculum", {}).get("horizon_schedule") or []
        stages = [
            {"step": int(step), "stage": index, "max_turns": int(turns)}
            for index, (step, turns) in enumerate(schedule)
        ]
        echo_traps: list[dict[str, Any]] = []
        with contextlib.suppress(FileNotFoundError):
            for line in (self.run_dir / ECHO_TRAP_FILE).read_bytes().splitlines():
                with contextlib.suppress(orjson.JSONDecodeError):
                    event = orjson.loads(line)
                    if isinstance(event, dict) and isinstance(event.get("step"), int):
                        echo_traps.append(event)
        return {"stages": stages, "echo_traps": echo_traps}

    def tokenizer_dir(self) -> Path | None:
        """Where this run's tokenizer is: its newest published policy, else the config's model."""
        policies = sorted(
            (int(path.name.removeprefix("policy-v")), path)
            for path in self.run_dir.glob("policy-v*")
            if path.name.removeprefix("policy-v").isdigit() and (path / "tokenizer_config.json").is_file()
        )
        if policies:
            return policies[-1][1]
        model = self.config().get("model", {}).get("path")
        return Path(model) if model and (Path(model) / "tokenizer_config.json").is_file() else None

    def summary(self, live_state: str | None) -> dict[str, Any]:
        self.metrics.refresh()
        config = self.config()
        status = read_run_status(self.run_dir)
        if live_state is not None:
            state = live_state
        elif status is None:
            state = "unknown"
        elif status.state in ACTIVE_STATES and time.time() - status.updated_at > STALE_AFTER_S:
            state = "stale"
        else:
            state = status.state
        return {
            "name": self.name,
            "status": state,
            "live": live_state is not None,
            "started": status.started_at if status else self.metrics.first_time,
            "updated": status.updated_at if status else self.metrics.last_time,
            "step": max(self.metrics.last_step, status.step if status else 0),
            "total_steps": status.total_steps if status else config.get("optim", {}).get("total_steps"),
            "last_success": self.metrics.last("rollout/success"),
            "last_eval_success": self.metrics.last("eval/success"),
            "envs": [
                spec.get("id") for spec in config.get("envs", {}).get("mix", []) if isinstance(spec, dict)
            ],
            "algorithm": config.get("algorithm", {}).get("advantage"),
        }


class RunsDirectory:
    """The runs under ``root``; ``live_run`` (the trainer serving the page) reports its own state."""

    def __init__(
        self, root: Path, *, live_run: str | None = None, live_state: Callable[[], str] | None = None
    ) -> None:
        self.root = root.resolve()
        self.live_run = live_run
        self.live_state = live_state
        self._readers: dict[str, RunReader] = {}

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            path.name
            for path in self.root.iterdir()
            if RUN_NAME.match(path.name)
            and path.is_dir()
            and ((path / CONFIG_FILE).is_file() or (path / METRICS_FILE).is_file())
        )

    def reader(self, name: str) -> RunReader:
        """The run called ``name``; an ApiError 404 for anything that is not one of ``names()``."""
        if not RUN_NAME.match(name) or name not in self.names():
            raise not_found("run", name)
        path = (self.root / name).resolve()
        if path.parent != self.root:  # a symlink pointing out of the runs directory
            raise not_found("run", name)
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers[name] = RunReader(path)
        return reader

    def summaries(self) -> list[dict[str, Any]]:
        runs = []
        for name in self.names():
            live = self.live_state() if name == self.live_run and self.live_state is not None else None
            runs.append(self.reader(name).summary(live))
        runs.sort(key=lambda run: run["started"] or 0.0, reverse=True)
        return runs
