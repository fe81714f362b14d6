"""Load benchmark (``make bench``): an env server under a load generator that is not Python, and
the trajectory stream through Redis.

**Env server under wrk.** ``wrk`` (C, a Debian package) with ``bench/wrk_step.lua`` posts steps
to TextCraft instances of one game env server: every request ``POST /instances/{id}/step`` with an
action the env refuses, so no instance ends. With 2 cores or more the server is pinned to core 0
and wrk to core 1, so neither measures the other's CPU. At 64 and 256 connections it reports
steps/s, p50/p90/p99/max latency and errors, for three servers started the same way:

* ``shipped``: the server as it runs (Python's cyclic collector on, the start-up heap frozen by
  ``services.http_app``);
* ``unfrozen``: the same with ``gc.freeze`` made a no-op, what every service did before;
* ``gc off``: the collector disabled for the whole process: the floor that GC pauses are
  measured against (its p99 is the tail without them).

**Trajectories through Redis.** 4 KB trajectories published in batches with
``StreamQueue.publish_many`` by a process of their own (a rollout worker's side) and consumed,
validated and acked by the trainer's group here (``consume`` + ``ack``), on a private
``redis-server``: trajectories per second end to end (target: at least 5,000).

Every variant's own collector is timed by the server (``python_gc_pause_seconds`` on /metrics):
the table shows the full collections and the milliseconds per second the collector held the
event loop during each wrk run, which a latency tail on a shared VM cannot tell apart from CPU
steal.

    .venv/bin/python bench/load.py [--seconds 20] [--connections 64,256]

Results go to ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.env_server import EnvServerProcess, wide_console  # noqa: E402
from deploy.redis_local import start_redis_server  # noqa: E402
from services.queue import connect, trajectory_queue  # noqa: E402
from services.rollout_protocol import RolloutJob, RunKeys, Trajectory, Turn  # noqa: E402

ENV = "game/textcraft"
INSTANCES = 256
WRK_SCRIPT = REPO_ROOT / "bench" / "wrk_step.lua"
RESULTS = REPO_ROOT / "bench" / "results" / "load.json"
# How each server variant's Python starts before it runs ``python -m deploy``.
VARIANTS = {
    "shipped": "pass",
    "unfrozen": "import gc; gc.freeze = lambda: None",
    "gc off": "import gc; gc.disable()",
}
P99_TARGET_MS = 25.0
REDIS_TARGET_PER_S = 5000.0


def cores() -> tuple[str | None, str | None]:
    """The cores the server and wrk are pinned to, or None each on a machine with one core."""
    return ("0", "1") if (os.cpu_count() or 1) >= 2 and shutil.which("taskset") else (None, None)


def pinned(command: list[str], core: str | None) -> list[str]:
    return ["taskset", "-c", core, *command] if core is not None else command


class VariantServer(EnvServerProcess):
    """A game env server whose Python first runs ``prelude``, pinned to ``core``."""

    def __init__(self, prelude: str, core: str | None) -> None:
        super().__init__(ENV)
        self.prelude = prelude
        self.core = core

    def command(self) -> list[str]:
        python = [
            sys.executable,
            "-c",
            f"{self.prelude}; import runpy, sys; sys.argv[0] = 'deploy'; runpy.run_module('deploy', run_name='__main__', alter_sys=True)",
        ]
        return pinned([*python, "env", "serve", "game"], self.core)


def create_instances(url: str, count: int) -> list[str]:
    ids = []
    for seed in range(count):
        body = json.dumps({"env": ENV, "seed": seed}).encode()
        request = urllib.request.Request(
            f"{url}/instances", data=body, headers={"content-type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            ids.append(json.loads(response.read())["instance_id"])
    return ids


def gc_pauses(url: str) -> dict[str, tuple[float, float]]:
    """``generation -> (collections, seconds paused)`` so far, off the server's /metrics
    (``python_gc_pause_seconds``, services/http_app.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "python_gc_pause_seconds":
            continue
        for sample in family.samples:
            slot = totals.setdefault(sample.labels["generation"], [0.0, 0.0])
            if sample.name.endswith("_count"):
                slot[0] = sample.value
            elif sample.name.endswith("_sum"):
                slot[1] = sample.value
    return {generation: (count, paused) for generation, (count, paused) in totals.items()}


def run_wrk(url: str, ids: list[str], connections: int, seconds: float, core: str | None) -> dict[str, Any]:
    """One wrk run, with the collections the server made meanwhile."""
    before = gc_pauses(url)
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{seconds:g}s",
        "--timeout",
        "10s",
        "-s",
        str(WRK_SCRIPT),
        url,
    ]
    done = subprocess.run(
        pinned(command, core),
        env={**os.environ, "INSTANCES": ",".join(ids)},
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["steps_per_s"] = report["requests"] / report["duration_s"]
    after = gc_pauses(url)
    report["gc"] = {
        generation: {
            "collections": count - before.get(generation, (0.0, 0.0))[0],
            "paused_s": paused - before.get(generation, (0.0, 0.0))[1],
        }
        for generation, (count, paused) in after.items()
    }
    return report


def bench_env_server(args: argparse.Namespace) -> dict[str, Any]:
    server_core, wrk_core = cores()
    results: dict[str, Any] = {}
    for name, prelude in VARIANTS.items():
        with VariantServer(prelude, server_core) as server:
            ids = create_instances(server.url, INSTANCES)
            run_wrk(server.url, ids, 64, 3, wrk_core)  # warm-up: code paths, allocator, caches
            results[name] = {
                str(connections): run_wrk(server.url, ids, connections, args.seconds, wrk_core)
                for connections in args.connections
            }
    return {"pinned": server_core is not None, "instances": INSTANCES, "variants": results}


def make_trajectory(index: int) -> Trajectory:
    """A trajectory whose JSON is about 4 KB (4,084 bytes): one turn, its text and its tokens."""
    prompt, response = 250, 50
    turn = Turn(
        observation="x" * 950,
        response="right",
        actions=["right"],
        reward=0.0,
        done=True,
        valid=True,
        policy_version=0,
        prompt_tokens=prompt,
        response_tokens=response,
    )
    job = RolloutJob(
        run_id="bench-load",
        env="game/frozenlake",
        seed=index,
        group_id=f"g{index // 8}",
        max_turns=4,
        policy_version=0,
    )
    return Trajectory.from_job(
        job,
        turns=[turn],
        token_ids=[7] * (prompt + response),
        loss_mask=[0] * prompt + [1] * response,
        logprobs=[0.0] * prompt + [-1.25] * response,
        num_turns=1,
        worker_id="bench",
    )


REDIS_RUN = RunKeys("bench-load")
BATCH = 64


def produce(url: str, seconds: float) -> None:
    """A rollout worker's side, in a process of its own as workers are: batches of 64."""

    async def go() -> None:
        redis = connect(url)
        queue = trajectory_queue(redis, REDIS_RUN)
        batch = [make_trajectory(i) for i in range(BATCH)]
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            await queue.publish_many(batch)
        await redis.aclose()

    asyncio.run(go())


async def bench_redis(seconds: float) -> dict[str, Any]:
    """A producer process publishes for ``seconds`` while the trainer's side, here, reads 512 at
    a time (each entry parsed and validated, as the trainer does), acks and deletes them; then
    what is left is drained. Rate: trajectories consumed per second, first read to last."""
    import multiprocessing

    server = start_redis_server()
    try:
        redis = connect(server.url)
        queue = trajectory_queue(redis, REDIS_RUN)
        await queue.ensure_group()
        producer = multiprocessing.get_context("spawn").Process(target=produce, args=(server.url, seconds))
        producer.start()
        consumed = 0
        started: float | None = None
        finished = 0.0
        deliveries: list[Any] = []
        while producer.is_alive() or deliveries:  # after the producer: until a read finds nothing
            deliveries = await queue.consume("trainer", count=512, block_ms=100)
            if deliveries:
                started = started or time.monotonic()
                finished = time.monotonic()
            await queue.ack([delivery.entry_id for delivery in deliveries])
            consumed += len(deliveries)
        elapsed = finished - started if started is not None else 0.0
        producer.join(timeout=30)
        await redis.aclose()
        size = len(make_trajectory(0).model_dump_json())
        return {"trajectory_bytes": size, "consumed": consumed, "per_s": consumed / max(elapsed, 1e-9)}
    finally:
        server.stop()


def full_gc_pause_ms(rows: dict[str, Any]) -> float | None:
    """The mean pause of a full (generation 2) collection over every wrk run of one server."""
    full = [row["gc"].get("2", {"collections": 0.0, "paused_s": 0.0}) for row in rows.values()]
    count = sum(part["collections"] for part in full)
    return 1e3 * sum(part["paused_s"] for part in full) / count if count else None


def render(results: dict[str, Any]) -> None:
    console = wide_console()
    from rich.table import Table

    env = results["env_server"]
    table = Table(
        title=f"{ENV} steps under wrk ({'server and wrk pinned to a core each' if env['pinned'] else 'not pinned'})"
    )
    columns = ("server", "connections", "steps/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors")
    for column in (*columns, "full GCs", "ms per full GC", "ms in GC per s"):
        table.add_column(column, justify="right")
    floor = env["variants"]["gc off"]
    for name, rows in env["variants"].items():
        for connections, row in rows.items():
            ratio = row["p99_ms"] / floor[connections]["p99_ms"]
            full = row["gc"].get("2", {"collections": 0.0, "paused_s": 0.0})
            table.add_row(
                name,
                connections,
                f"{row['steps_per_s']:,.0f}",
                f"{row['p50_ms']:.1f}",
                f"{row['p90_ms']:.1f}",
                f"{row['p99_ms']:.1f} ({ratio:.2f}x gc off)",
                f"{row['max_ms']:.1f}",
                str(row["socket_errors"] + row["non_2xx"]),
                f"{full['collections']:.0f}",
                f"{1e3 * full['paused_s'] / full['collections']:.1f}" if full["collections"] else "-",
                f"{1e3 * sum(g['paused_s'] for g in row['gc'].values()) / row['duration_s']:.1f}",
            )
    console.print(table)
    shipped = env["variants"]["shipped"]["64"]["p99_ms"]
    console.print(f"p99 at 64 connections, collector on: {shipped:.1f} ms (target < {P99_TARGET_MS:g} ms)")
    pauses = {name: full_gc_pause_ms(env["variants"][name]) for name in ("shipped", "unfrozen")}
    if all(pauses.values()):
        console.print(
            f"a full collection stops the server {pauses['shipped']:.1f} ms with the start-up heap frozen, "
            f"{pauses['unfrozen']:.1f} ms without ({pauses['unfrozen'] / pauses['shipped']:.0f}x longer)"
        )
    redis = results["redis"]
    console.print(
        f"trajectories through Redis ({redis['trajectory_bytes']:,} B each): {redis['per_s']:,.0f}/s "
        f"(target >= {REDIS_TARGET_PER_S:,.0f}/s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="Each wrk run's duration.")
    parser.add_argument(
        "--connections", type=lambda text: [int(part) for part in text.split(",")], default=[64, 256]
    )
    parser.add_argument("--redis-seconds", type=float, default=10.0)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: sudo apt-get install wrk (make bench installs it)")
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "env_server": bench_env_server(args),
        "redis": asyncio.run(bench_redis(args.redis_seconds)),
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    render(results)


if __name__ == "__main__":
    main()
