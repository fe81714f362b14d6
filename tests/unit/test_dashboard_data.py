"""The dashboard's readers: downsampling, incremental metrics, the trajectory log, run confinement."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dashboard_data import episode, make_run

from services.errors import ApiError
from trainer.dashboard.runs import RunsDirectory, downsample
from trainer.dashboard.samples import SampleFilter, TrajectoryRecorder, TrajectorySamples
from trainer.metrics import MetricsLogger


def test_downsample_caps_points_keeps_the_last_exact_and_averages_buckets() -> None:
    steps = list(range(1, 10_001))
    times = [float(s) for s in steps]
    values: list[float | None] = [float(s % 2) for s in steps]
    out_steps, out_times, out_values = downsample(steps, times, values, 1000)
    assert len(out_steps) == len(out_values) == len(out_times) == 1000
    assert out_steps[-1] == 10_000 and out_values[-1] == 0.0
    assert out_steps == sorted(out_steps)
    assert all(abs(v - 0.5) < 0.1 for v in out_values[:-1])  # buckets of ~10 alternating 0/1
    assert downsample(steps[:50], times[:50], values[:50], 1000) == (steps[:50], times[:50], values[:50])


def test_downsample_bucket_of_only_missing_values_is_none() -> None:
    steps = list(range(100))
    values: list[float | None] = [None] * 50 + [1.0] * 50
    _, _, out = downsample(steps, [0.0] * 100, values, 10)
    assert out[0] is None and out[-2] == 1.0


def test_metrics_are_read_incrementally_and_reread_after_truncation(tmp_path: Path) -> None:
    runs = RunsDirectory(tmp_path)
    run_dir = make_run(tmp_path, "a", steps=10)
    metrics = runs.reader("a").metrics
    metrics.refresh()
    assert metrics.last_step == 10
    assert metrics.matching(["env/*/success", "rollout/success", "nope"]) == [
        "env/game/bandit/success",
        "rollout/success",
    ]
    cursor = metrics.cursor
    logger = MetricsLogger(run_dir)
    logger.log(11, {"rollout/success": 0.5})
    logger.log(9, {"eval/success": 0.25})  # an eval round of step 9's policy, logged late
    logger.close()
    metrics.refresh()
    new = metrics.series(["rollout/success", "eval/success"], 1000, after=cursor)
    assert new["rollout/success"]["step"] == [11] and new["rollout/success"]["value"] == [0.5]
    assert new["eval/success"]["step"] == [9]
    assert metrics.series(["rollout/success"], 1000, after=metrics.cursor)["rollout/success"]["step"] == []
    logger = MetricsLogger(run_dir)
    logger.log(5, {"rollout/success": 0.0})  # out of order: kept in step order
    logger.close()
    metrics.refresh()
    assert metrics.series(["rollout/success"], 1000, None)["rollout/success"]["step"][4:7] == [5, 5, 6]
    # A resume from the checkpoint of step 4 truncates the file: the reader starts over.
    MetricsLogger(run_dir, resume_step=4).close()
    metrics.refresh()
    assert metrics.last_step == 4 and metrics.cursor == 4
    assert metrics.series(["rollout/success"], 1000, None)["rollout/success"]["step"] == [1, 2, 3, 4]


def test_a_line_being_written_waits_for_its_newline(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "a", steps=2)
    metrics = RunsDirectory(tmp_path).reader("a").metrics
    metrics.refresh()
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "time": 1.0, "rollout/success"')
    metrics.refresh()
    assert metrics.last_step == 2
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write(": 1.0}\n")
    metrics.refresh()
    assert metrics.last_step == 3 and metrics.last("rollout/success") == 1.0


@pytest.mark.parametrize("name", ["..", "../a", "a/../a", ".hidden", "", "nope", "a/b"])
def test_names_outside_the_runs_directory_are_not_found(tmp_path: Path, name: str) -> None:
    make_run(tmp_path / "runs", "a", steps=1)
    make_run(tmp_path, "outside", steps=1)
    runs = RunsDirectory(tmp_path / "runs")
    with pytest.raises(ApiError) as error:
        runs.reader(name)
    assert error.value.status == 404


def test_a_symlink_out_of_the_runs_directory_is_not_a_run(tmp_path: Path) -> None:
    make_run(tmp_path, "secret", steps=1)
    (tmp_path / "runs").mkdir()
    os.symlink(tmp_path / "secret", tmp_path / "runs" / "link")
    runs = RunsDirectory(tmp_path / "runs")
    with pytest.raises(ApiError):
        runs.reader("link")


def test_run_summaries_and_events(tmp_path: Path) -> None:
    make_run(tmp_path, "a", steps=10)
    make_run(tmp_path, "b", steps=3, state="training")  # its status is old: the trainer died
    runs = RunsDirectory(tmp_path, live_run="a", live_state=lambda: "training")
    summaries = {run["name"]: run for run in runs.summaries()}
    assert summaries["a"]["live"] and summaries["a"]["status"] == "training"
    assert summaries["a"]["step"] == 10 and summaries["a"]["last_success"] == 1.0
    assert summaries["a"]["envs"] == ["game/bandit"] and summaries["a"]["algorithm"] == "grpo"
    assert summaries["b"]["status"] == "stale" and not summaries["b"]["live"]
    events = runs.reader("a").events()
    assert events["stages"] == [
        {"step": 0, "stage": 0, "max_turns": 2},
        {"step": 5, "stage": 1, "max_turns": 4},
    ]
    assert [(e["step"], e["kind"]) for e in events["echo_traps"]] == [(2, "collapse")]


def test_trajectory_log_round_trip_filters_and_groups(tmp_path: Path) -> None:
    make_run(tmp_path, "a", steps=1)
    samples = TrajectorySamples(tmp_path / "a")
    samples.refresh()
    total, found = samples.query(SampleFilter(), 10)
    assert total == 4 and {t["status"] for t in found} == {"kept", "filtered"}
    assert samples.query(SampleFilter(status="filtered"), 10)[0] == 2
    assert samples.query(SampleFilter(success=True), 10)[0] == 1
    assert samples.query(SampleFilter(min_reward=0.5), 10)[1][0]["job_id"] == "g1-1"
    record = samples.find("g1-0")
    assert record is not None and record["advantages"] == [0, 0, 0, 0.5, 0.5]
    assert record["loss_mask"] == [0, 0, 0, 1, 1] and record["logprobs"][-1] == -2.5
    assert [r["job_id"] for r in samples.group("g2")] == ["g2-0", "g2-1"]


def test_trajectory_reader_follows_rotation_and_keeps_a_bounded_ring(tmp_path: Path) -> None:
    recorder = TrajectoryRecorder(tmp_path, max_bytes=3000, keep=2)
    samples = TrajectorySamples(tmp_path, per_env=5)
    for index in range(40):
        recorder.record_group([episode(f"j{index}", f"g{index}", reward=1.0)], status="kept", step=index)
        if index % 7 == 0:
            samples.refresh()
    recorder.close()
    samples.refresh()
    assert (tmp_path / "trajectories.jsonl.1").exists()  # it rotated
    total, found = samples.query(SampleFilter(), 100)
    assert total == 5
    assert [t["job_id"] for t in found] == [f"j{i}" for i in range(39, 34, -1)]


def test_the_standalone_dashboard_shows_the_run_written_last_by_its_configured_name(tmp_path: Path) -> None:
    from deploy.dashboard import newest_run

    assert newest_run(tmp_path) == "run"  # nothing yet: the trainer's default name
    older, newer = make_run(tmp_path, "older", steps=2), make_run(tmp_path, "newer", steps=2)
    (tmp_path / "not-a-run").mkdir()
    (newer / "config.yaml").write_text(
        (newer / "config.yaml").read_text().replace("name: newer", "name: live-7")
    )
    os.utime(older / "config.yaml", (1, 1))
    os.utime(older / "metrics.jsonl", (1, 1))
    os.utime(newer / "config.yaml", (1, 1))
    os.utime(newer / "metrics.jsonl", (2, 2))
    assert newest_run(tmp_path) == "live-7"  # its run.name, which its workers' Redis keys carry
    os.utime(older / "metrics.jsonl", (3, 3))  # older trains again
    assert newest_run(tmp_path) == "older"
