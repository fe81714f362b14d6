"""Training metrics: one JSON line per update in ``<run_dir>/metrics.jsonl``, plus optional sinks.

Keys are flat and named as docs/architecture.md says: ``train/*`` (pg_loss, vf_loss, entropy, kl, clipfrac,
grad_norm, lr), ``rollout/*``, ``env/<env>/success``, ``env/<env>/turns`` (``<env>`` is the env id,
slash included: ``env/game/frozenlake/success``), ``system/*``. Each line is
``{"step": N, "time": unix seconds, "<key>": value, ...}``; a non-finite value is written as
``null`` (JSON has no NaN). The logger also keeps the latest value of every key for the
Prometheus ``/metrics`` exposure (:func:`register_prometheus`), and mirrors each update to
TensorBoard and W&B (offline) when the config asks and the packages are installed: neither is
a dependency of stargym.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

METRICS_FILE = "metrics.jsonl"
PROMETHEUS_NAMESPACE = "stargym"
RESERVED_KEYS = frozenset({"step", "time"})
_INVALID_PROMETHEUS = re.compile(r"[^a-zA-Z0-9_:]+")


class MetricsSinkUnavailable(RuntimeError):
    """An optional sink (TensorBoard, W&B) was asked for but its package is not installed."""


def prometheus_name(key: str, namespace: str = PROMETHEUS_NAMESPACE) -> str:
    """``train/pg_loss`` → ``stargym_train_pg_loss``; every run of other characters becomes ``_``."""
    body = _INVALID_PROMETHEUS.sub("_", key).strip("_")
    return f"{namespace}_{body}" if namespace else body


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested dicts become slash-joined keys; values become floats (bools as 0/1)."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
            continue
        if hasattr(value, "item") and callable(value.item):  # 0-d tensors and numpy scalars
            value = value.item()
        if isinstance(value, bool | int | float):
            flat[name] = float(value)
        else:
            raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
    return flat


class MetricsLogger:
    """Appends one line per :meth:`log` call to ``<run_dir>/metrics.jsonl`` and feeds the sinks.

    ``resume_step``: on resume from the checkpoint of that step, lines of later steps (logged
    after the checkpoint by the crashed run, and about to be redone) are dropped first, so the
    file reads as one run. ``tensorboard``/``wandb`` ask for the optional sinks; a sink whose
    package is missing raises :class:`MetricsSinkUnavailable` at construction, not mid-run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume_step: int | None = None,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "stargym",
        wandb_mode: str = "offline",
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._lock = threading.Lock()
        self.latest: dict[str, float] = {}
        self.step: int | None = None
        if resume_step is not None:
            truncate_metrics(self.run_dir, resume_step)
            for record in read_metrics(self.run_dir):
                self._remember(record)
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            self._tb = _open_tensorboard(self.run_dir / "tensorboard")
        if wandb:
            self._wandb = _open_wandb(self.run_dir, wandb_project, wandb_mode, run_name, config)
        self._file = self.path.open("a", encoding="utf-8")

    @classmethod
    def from_config(cls, config: Any, *, resume_step: int | None = None) -> MetricsLogger:
        """From a :class:`trainer.config.TrainConfig` (duck-typed: run, metrics, run_dir)."""
        return cls(
            config.run_dir,
            resume_step=resume_step,
            tensorboard=config.metrics.tensorboard,
            wandb=config.metrics.wandb.enabled,
            wandb_project=config.metrics.wandb.project,
            wandb_mode=config.metrics.wandb.mode,
            run_name=config.run.name,
            config=config.model_dump(mode="json"),
        )

    def log(self, step: int, metrics: Mapping[str, Any], *, timestamp: float | None = None) -> dict[str, Any]:
        """Write one line for update ``step``; returns the record written."""
        flat = flatten(metrics)
        clash = RESERVED_KEYS & flat.keys()
        if clash:
            raise ValueError(f"metric keys {sorted(clash)} are reserved")
        record: dict[str, Any] = {"step": int(step), "time": time.time() if timestamp is None else timestamp}
        record.update({key: value if math.isfinite(value) else None for key, value in flat.items()})
        line = json.dumps(record, allow_nan=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            # A part logged late for an earlier step (an eval round) does not move the step back.
            self.step = int(step) if self.step is None else max(self.step, int(step))
            self.latest.update(flat)
        if self._tb is not None:
            for key, value in flat.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(flat, step=step)
        return record

    def snapshot(self) -> tuple[int | None, dict[str, float]]:
        """The last logged step and the latest value of every key (for exposures)."""
        with self._lock:
            return self.step, dict(self.latest)

    def register_prometheus(
        self, registry: CollectorRegistry, namespace: str = PROMETHEUS_NAMESPACE
    ) -> Collector:
        return register_prometheus(self, registry, namespace)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _remember(self, record: Mapping[str, Any]) -> None:
        self.step = int(record["step"])
        for key, value in record.items():
            if key not in RESERVED_KEYS and value is not None:
                self.latest[key] = float(value)


class _LatestValues(Collector):
    """Yields one gauge per metric key at scrape time: keys appear as the run logs them."""

    def __init__(self, logger: MetricsLogger, namespace: str) -> None:
        self.logger = logger
        self.namespace = namespace

    def collect(self) -> Iterator[GaugeMetricFamily]:
        step, latest = self.logger.snapshot()
        if step is not None:
            yield GaugeMetricFamily(
                prometheus_name("step", self.namespace), "Last logged update step.", value=step
            )
        seen = {prometheus_name("step", self.namespace)}
        for key in sorted(latest):
            name = prometheus_name(key, self.namespace)
            if name in seen:  # two keys that sanitise alike: the first (sorted) wins
                continue
            seen.add(name)
            yield GaugeMetricFamily(name, f"Latest value of {key}.", value=latest[key])


def register_prometheus(
    logger: MetricsLogger, registry: CollectorRegistry, namespace: str = PROMETHEUS_NAMESPACE
) -> Collector:
    """Expose ``logger``'s latest values as gauges on ``registry`` (e.g. ``app.state.metrics_registry``).

    ``train/pg_loss`` is served as ``stargym_train_pg_loss``; ``stargym_step`` is the last step.
    Returns the collector (``registry.unregister(collector)`` removes it).
    """
    collector = _LatestValues(logger, namespace)
    registry.register(collector)
    return collector


# --- reading back -----------------------------------------------------------------------------


def read_metrics(run_dir: str | Path, since_step: int | None = None) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` with step > ``since_step``, in step order.

    Lines of one step are merged (later keys win), so a step logged in parts (train, then eval)
    or redone after a resume reads as one record. A torn last line (a crash mid-write) and any
    other unparsable line are skipped. A missing file reads as no records.
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    merged: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        record = parse_metrics_line(line)
        if record is None:
            continue
        step = record["step"]
        if since_step is not None and step <= since_step:
            continue
        merged.setdefault(step, {}).update(record)
    return [merged[step] for step in sorted(merged)]


def truncate_metrics(run_dir: str | Path, after_step: int) -> int:
    """Drop the lines of steps > ``after_step`` (and torn lines), atomically; returns lines dropped."""
    path = Path(run_dir) / METRICS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return 0
    kept = [
        line
        for line in lines
        if (record := parse_metrics_line(line)) is not None and record["step"] <= after_step
    ]
    if len(kept) == len(lines):
        return 0
    fd, temp = tempfile.mkstemp(prefix=f".{METRICS_FILE}.tmp-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    return len(lines) - len(kept)


def parse_metrics_line(line: str | bytes) -> dict[str, Any] | None:
    """One record of metrics.jsonl, or None for a torn or foreign line."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


# --- optional sinks ---------------------------------------------------------------------------


def _open_tensorboard(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MetricsSinkUnavailable(
            "metrics.tensorboard is true but the 'tensorboard' package is not installed: "
            "`pip install tensorboard`, or set metrics.tensorboard: false (metrics.jsonl is always written)"
        ) from None

    return SummaryWriter(log_dir=str(log_dir))


def _open_wandb(run_dir: Path, project: str, mode: str, run_name: str | None, config: Any) -> Any:
    try:
        import wandb
    except ImportError:
        raise MetricsSinkUnavailable(
            "metrics.wandb.enabled is true but the 'wandb' package is not installed: "
            "`pip install wandb`, or set metrics.wandb.enabled: false (metrics.jsonl is always written)"
        ) from None

    return wandb.init(
        project=project,
        name=run_name,
        id=run_name,
        resume="allow",
        mode=mode,
        dir=str(run_dir),
        config=dict(config) if config else None,
    )
