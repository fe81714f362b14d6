"""Metrics: JSONL round trip, resume truncation, Prometheus gauges, optional sinks."""

from __future__ import annotations

import gc
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.http_app import create_app
from services.settings import ServiceSettings
from trainer.config import TrainConfig
from trainer.metrics import (
    METRICS_FILE,
    MetricsLogger,
    MetricsSinkUnavailable,
    flatten,
    prometheus_name,
    read_metrics,
    truncate_metrics,
)


def test_one_line_per_update_and_read_back(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"train/pg_loss": 0.5, "env/game/frozenlake/success": 0.25, "system/step_s": 1.5})
        logger.log(2, {"train": {"pg_loss": torch.tensor(0.25), "entropy": 2}, "rollout/kept_ratio": True})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert first["env/game/frozenlake/success"] == 0.25
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [1, 2]
    assert records[1]["train/pg_loss"] == 0.25 and records[1]["train/entropy"] == 2.0
    assert records[1]["rollout/kept_ratio"] == 1.0
    assert [record["step"] for record in read_metrics(tmp_path, since_step=1)] == [2]
    assert read_metrics(tmp_path, since_step=2) == []
    assert read_metrics(tmp_path / "nowhere") == []


def test_a_step_logged_in_parts_reads_as_one_record_and_torn_lines_are_skipped(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log(3, {"train/pg_loss": 1.0}, timestamp=10.0)
        logger.log(3, {"env/game/bandit/success": 0.75}, timestamp=11.0)
        logger.log(4, {"train/pg_loss": math.nan})
    with (tmp_path / METRICS_FILE).open("a") as handle:
        handle.write('{"step": 5, "train/pg_lo')  # a crash mid-write
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [3, 4]
    assert records[0] == {"step": 3, "time": 11.0, "train/pg_loss": 1.0, "env/game/bandit/success": 0.75}
    assert records[1]["train/pg_loss"] is None  # NaN is written as null: the file stays valid JSON


def test_a_part_logged_late_for_an_earlier_step_keeps_the_latest_step(tmp_path: Path) -> None:
    # An eval round of step 2 finishes after update 3 was logged.
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"train/pg_loss": 1.0})
        logger.log(3, {"train/pg_loss": 0.5})
        logger.log(2, {"eval/success": 0.25})
        assert logger.snapshot() == (3, {"train/pg_loss": 0.5, "eval/success": 0.25})
    records = read_metrics(tmp_path)
    assert records[0] == {"step": 2, "time": records[0]["time"], "train/pg_loss": 1.0, "eval/success": 0.25}


def test_resume_drops_lines_after_the_checkpoint(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"train/lr": step / 10})
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        assert logger.snapshot() == (3, {"train/lr": 0.3})
        logger.log(4, {"train/lr": 0.45})
    lrs = [(record["step"], record["train/lr"]) for record in read_metrics(tmp_path)]
    assert lrs == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.45)]
    assert truncate_metrics(tmp_path, 10) == 0


def test_bad_values_and_reserved_keys_are_refused(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(TypeError, match="train/stage"):
            logger.log(1, {"train/stage": "warmup"})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 3})
    assert flatten({"a": {"b": {"c": 1}}}) == {"a/b/c": 1.0}


def test_prometheus_names_are_sanitised() -> None:
    assert prometheus_name("train/pg_loss") == "stargym_train_pg_loss"
    assert prometheus_name("env/game/frozenlake/success") == "stargym_env_game_frozenlake_success"
    assert prometheus_name("system/tokens-per-s.x") == "stargym_system_tokens_per_s_x"


def test_prometheus_gauges_hold_the_latest_values(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    with MetricsLogger(tmp_path) as logger:
        collector = logger.register_prometheus(registry)
        assert registry.get_sample_value("stargym_train_pg_loss") is None
        logger.log(1, {"train/pg_loss": 0.5, "env/game/frozenlake/success": 0.125})
        logger.log(2, {"train/pg_loss": -0.25})
        assert registry.get_sample_value("stargym_train_pg_loss") == -0.25
        assert registry.get_sample_value("stargym_env_game_frozenlake_success") == 0.125
        assert registry.get_sample_value("stargym_step") == 2
        registry.unregister(collector)
        assert registry.get_sample_value("stargym_step") is None


def test_gauges_are_served_on_the_service_metrics_route(tmp_path: Path) -> None:
    app = create_app("trainer", ServiceSettings())
    with MetricsLogger(tmp_path) as logger:
        logger.register_prometheus(app.state.metrics_registry)
        logger.log(7, {"rollout/reward_mean": 0.625})
        body = TestClient(app).get("/metrics").text
    assert "stargym_rollout_reward_mean 0.625" in body
    assert "stargym_step 7.0" in body


def test_missing_tensorboard_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail for real
    with pytest.raises(MetricsSinkUnavailable, match="pip install tensorboard"):
        MetricsLogger(tmp_path, tensorboard=True)


def test_missing_wandb_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MetricsSinkUnavailable, match=r"metrics\.wandb\.enabled"):
        MetricsLogger(tmp_path, wandb=True)


def test_tensorboard_events_are_written(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"train/pg_loss": 0.5})
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_logger_from_config(tmp_path: Path) -> None:
    config = TrainConfig.from_dict({"run": {"name": "demo", "output_dir": str(tmp_path / "demo")}})
    with MetricsLogger.from_config(config) as logger:
        logger.log(1, {"train/lr": 1e-6})
    assert read_metrics(tmp_path / "demo")[0]["train/lr"] == 1e-6


def test_every_service_times_its_garbage_collections_while_it_runs_and_freezes_its_startup_heap() -> None:
    app = create_app("env server (game)", ServiceSettings())
    gc.unfreeze()  # an earlier app of this process froze its heap
    hooks = len(gc.callbacks)
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 0  # the start-up heap, never walked again
        assert len(gc.callbacks) == hooks + 1
        gc.collect(2)
        gc.collect(0)
        text = client.get("/metrics").text
        counts = {
            sample.labels["generation"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "python_gc_pause_seconds"
            for sample in family.samples
            if sample.name == "python_gc_pause_seconds_count"
        }
        assert counts["2"] >= 1 and counts["0"] >= 1, counts
    assert len(gc.callbacks) == hooks  # a stopped app leaves no hook behind
    gc.unfreeze()
