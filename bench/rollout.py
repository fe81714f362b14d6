"""Rollout benchmark (``make bench``): 64 concurrent FrozenLake episodes through the real rollout path.

Everything is a real process on free loopback ports, as a user runs it:

* a private ``redis-server`` (``deploy.redis_local.start_redis_server``);
* ``stargym env serve game``;
* ``stargym engine serve --model DIR`` on the tiny policy made in a temp dir from FrozenLake's texts
  (``init_tiny_model``, as ``stargym train`` makes the recipe's model);
* **worker path**: ``stargym rollout --concurrency 64``, jobs pushed to ``stargym:<run>:jobs`` (kept
  topped up so the worker never runs dry) and trajectories read back from
  ``stargym:<run>:trajectories``;
* **direct path** (comparison): ``rollout_server.episode.run_episode`` driven by 64 asyncio tasks
  in this process, against the same env server and engine: the episode runner without the queue;
* **engine in the worker** (``stargym up --engine worker``): ``stargym rollout --engine-model DIR``, the
  engine in the worker's own process, reached without HTTP; the report gives its rollout CPU per
  turn (engine, worker and env server together) and episodes/s over the worker path's
  (``--no-in-worker`` skips it);
* **agent path**: the same jobs played by ``examples/openai_agent.py`` (the README's worked
  example, written with nothing but ``openai``) through the worker's recording proxy, on today's
  engine; the report gives its rollout CPU per turn and episodes/s over the worker path's, what
  a user pays for bringing an agent of their own (``--no-agent`` skips it).

The worker path runs twice, each time on an engine of its own: first the engine as it was before
batched prefill (``--prefill-tokens 0``: each prompt whole, in a forward pass of its own, the
baseline; ``--no-baseline`` skips it), then today's (``--prefill-tokens``, default 2048); the
report gives the second's episodes/s over the first's (target 1.8x).

Each path is warmed up, then measured over a steady-state window: episodes/s and env steps/s from
the trajectories completed in it, sampled tokens/s and **engine utilisation** (the share of wall
time the engine thread spent computing: ``engine_busy_seconds_total`` from its ``/metrics``,
before and after) from the engine's own counters, plus the CPU each process used, the engine
thread's time on a CPU and waiting for one (``/proc`` schedstat: on a shared machine a busy engine
may be mostly waiting for a core), the mean number of sequences inside the engine, and where the
64 episode slots are (Little's law on the trajectories' timings: waiting for the engine, in env
calls, between episodes). ``--profile`` adds a py-spy sample of the engine and the worker
(``pip install py-spy`` or ``PY_SPY=/path/to/py-spy``).
FrozenLake 4x4, at most 8 turns, plain action format (a reply stops at its first action token),
``max_tokens`` 8 per turn, temperature 1: the ``configs/frozenlake-tiny.yaml`` recipe.
The target is an engine utilisation of at least 85%. Results go to ``bench/results/rollout.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from deploy.launcher import ServiceProcess, free_port, start_service  # noqa: E402
from deploy.model_init import init_tiny_model  # noqa: E402
from deploy.redis_local import start_redis_server  # noqa: E402
from rollout_server.settings import ENGINE_MOUNT  # noqa: E402
from services.rollout_protocol import (  # noqa: E402
    DATA_FIELD,
    ROLLOUT_GROUP,
    RolloutJob,
    RunKeys,
    SamplingParams,
    Trajectory,
)

ENV = "game/frozenlake"
TARGET_UTILISATION = 0.85
TARGET_SPEEDUP = 1.8  # episodes/s of batched prefill over the engine before it (issue 15)
ONE_PER_PASS = "one prompt per prefill pass"
BATCHED = "batched prefill"
IN_WORKER = "worker, engine in its process"
AGENT_PATH = "worker, an openai-client agent"
AGENT = "examples.openai_agent:play"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- measuring ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def busiest_thread(pid: int) -> int:
    """The thread of ``pid``, the main one aside, that has run longest: in an engine, its batching thread.

    (The main thread, which loaded torch and the model and serves HTTP, may have run longer.)
    """
    best, best_time = pid, -1
    for task in Path(f"/proc/{pid}/task").iterdir():
        if task.name == str(pid):
            continue
        try:
            on_cpu = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if on_cpu > best_time:
            best, best_time = int(task.name), on_cpu
    return best


def thread_schedstat(pid: int, tid: int) -> tuple[float, float]:
    """Seconds thread ``tid`` has run on a CPU and waited, runnable, for one (``schedstat``)."""
    try:
        on_cpu, waiting, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def engine_counters(url: str) -> dict[str, float]:
    """The engine's ``engine_*`` samples from /metrics, by name (``_total`` dropped).

    ``at`` is when they were read: the midpoint of the request, which on a busy engine takes a
    few milliseconds to be answered.
    """
    before = time.perf_counter()
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counters = {
        name.removesuffix("_total"): float(value)
        for name, value in (line.split() for line in text.splitlines() if line.startswith("engine_"))
    }
    counters["at"] = (before + time.perf_counter()) / 2
    return counters


class Window:
    """Snapshot of every counter at the start of a measured window; :meth:`close` gives the deltas."""

    def __init__(self, engine_url: str, engine_pid: int, pids: dict[str, int], db: redis.Redis) -> None:
        """``pids``: the processes whose CPU is counted (the engine's among them, once)."""
        self.engine_url = engine_url
        self.engine_pid = engine_pid
        self.pids = pids
        self.db = db
        self.engine = engine_counters(engine_url)
        self.cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self.engine_tid = busiest_thread(engine_pid)
        self.engine_thread = thread_schedstat(engine_pid, self.engine_tid)
        self.redis_ms = _redis_ms(db)
        self.in_flight: list[float] = []

    def sample(self) -> None:
        """Sequences inside the engine right now (running or queued)."""
        self.in_flight.append(engine_counters(self.engine_url)["engine_sequences_in_flight"])

    def close(self) -> dict[str, Any]:
        engine = engine_counters(self.engine_url)
        cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        on_cpu, waiting = thread_schedstat(self.engine_pid, self.engine_tid)
        delta = {name: engine[name] - self.engine.get(name, 0.0) for name in engine}
        seconds = delta["at"]
        decode_tokens = delta["engine_generated_tokens"] - delta["engine_finished_sequences"]
        return {
            "seconds": seconds,
            "span": (self.engine["at"], engine["at"]),
            "redis_ms": (self.redis_ms, _redis_ms(self.db)),
            "engine_utilisation": delta["engine_busy_seconds"] / seconds,
            # The engine thread's wall time split: on a CPU, and runnable but waiting for one (a
            # busy engine on an oversubscribed machine counts as busy while it waits).
            "engine_thread_on_cpu_share": (on_cpu - self.engine_thread[0]) / seconds,
            "engine_thread_runqueue_share": (waiting - self.engine_thread[1]) / seconds,
            "engine_tokens_per_s": delta["engine_generated_tokens"] / seconds,
            "engine_requests_per_s": delta["engine_finished_sequences"] / seconds,
            "engine_decode_steps_per_s": delta["engine_decode_steps"] / seconds,
            "mean_decode_batch": decode_tokens / delta["engine_decode_steps"] if delta["engine_decode_steps"] else 0.0,
            "prompt_tokens_per_request": delta["engine_prompt_tokens"] / max(delta["engine_finished_sequences"], 1),
            "reused_prompt_share": delta["engine_reused_prompt_tokens"] / max(delta["engine_prompt_tokens"], 1),
            "mean_sequences_in_engine": statistics.fmean(self.in_flight) if self.in_flight else None,
            "cpu_cores": {name: (cpu[name] - self.cpu[name]) / seconds for name in cpu},
        }  # fmt: skip


def _redis_ms(db: redis.Redis) -> int:
    seconds, micros = db.time()
    return seconds * 1000 + micros // 1000


def summarise(trajectories: list[Trajectory], window: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """Rates over the window, from the trajectories completed in it and the engine's counters."""
    window = {key: value for key, value in window.items() if key not in ("span", "redis_ms")}
    seconds = window["seconds"]
    rate = len(trajectories) / seconds
    turns = sum(t.num_turns for t in trajectories)
    steps = sum(1 for t in trajectories for turn in t.turns if turn.actions)
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    timing = {
        key: statistics.fmean(t.timings.get(key, 0.0) for t in trajectories) if trajectories else 0.0
        for key in ("total_s", "generate_s", "env_s", "busy_wait_s", "worker_s", "queue_wait_s")
        if all(key in t.timings for t in trajectories)
    }
    # Little's law: where the ``concurrency`` episode slots are on average. "between episodes" is
    # a slot's time from one episode's end to the next one's start (publish, ack, read the next job).
    slots = {
        "waiting_for_engine": rate * timing.get("generate_s", 0.0),
        "in_env_calls": rate * timing.get("env_s", 0.0),
        "episode_runner_cpu": rate
        * (timing.get("total_s", 0.0) - timing.get("generate_s", 0.0) - timing.get("env_s", 0.0)),
        "between_episodes": concurrency - rate * timing.get("total_s", 0.0),
    }
    return {
        "concurrency": concurrency,
        "episodes": len(trajectories),
        "errors": sum(1 for t in trajectories if t.error),
        "episodes_per_s": rate,
        "env_steps_per_s": steps / seconds,
        "turns_per_s": turns / seconds,
        "sampled_tokens_per_s": tokens / seconds,
        "mean_turns": turns / len(trajectories) if trajectories else 0.0,
        "success_rate": sum(t.success for t in trajectories) / len(trajectories) if trajectories else 0.0,
        "episode_timings_mean_s": timing,
        # Of an episode's wall time, the share spent waiting for the engine: what keeps it busy.
        "generate_share_of_episode": timing["generate_s"] / timing["total_s"] if timing["total_s"] else 0.0,
        "episode_slots": slots,
        **window,
    }


# ---- the services ---------------------------------------------------------------------------


KEYS = RunKeys("bench-rollout")
"""The benchmark's run: the worker serves it, the feeder fills its job stream."""


def make_job(index: int, max_turns: int, max_tokens: int, agent: str | None = None) -> RolloutJob:
    """The ``index``-th job; ``agent``: played by that agent through a recording session."""
    return RolloutJob(
        run_id=KEYS.run_id,
        env=ENV,
        seed=index,
        group_id=f"g{index}",
        max_turns=max_turns,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=index),
        policy_version=0,
        action_format="plain",
        options={"size": 4},
        agent=agent,
    )


@contextmanager
def service(
    name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[ServiceProcess]:
    port = free_port()
    running = start_service(name, [*args, "--port", str(port)], port, log_dir, env=env, cwd=REPO_ROOT)
    try:
        yield running
    finally:
        running.stop()


class JobFeeder:
    """Keeps the run's job stream holding at least ``backlog`` undelivered jobs, so the worker never waits."""

    def __init__(self, db: redis.Redis, args: argparse.Namespace, agent: str | None = None) -> None:
        self.db = db
        self.args = args
        self.agent = agent
        self.issued = 0

    def top_up(self) -> None:
        # The worker deletes acked jobs: what is left is pending (being played) or undelivered.
        length = self.db.xlen(KEYS.jobs)
        try:
            pending = int(self.db.xpending(KEYS.jobs, ROLLOUT_GROUP)["pending"])
        except redis.ResponseError:  # no group yet: the worker has not started
            pending = 0
        missing = 4 * self.args.concurrency - (length - pending)
        if missing <= 0:
            return
        with self.db.pipeline(transaction=False) as pipe:
            for _ in range(missing):
                job = make_job(self.issued, self.args.max_turns, self.args.max_tokens, self.agent)
                pipe.xadd(KEYS.jobs, {DATA_FIELD: job.model_dump_json()})
                self.issued += 1
            pipe.execute()


def read_trajectories(db: redis.Redis, start_ms: int, end_ms: int) -> list[Trajectory]:
    """Trajectories whose stream entries were added in ``[start_ms, end_ms)`` (entry ids are Redis ms)."""
    entries = db.xrange(KEYS.trajectories, min=f"{start_ms}-0", max=f"({end_ms}-0")
    return [Trajectory.model_validate_json(fields[DATA_FIELD.encode()]) for _, fields in entries]


def bench_worker(
    args: argparse.Namespace, db: redis.Redis, redis_url: str, engine: ServiceProcess | None,
    env_server: ServiceProcess, redis_pid: int, model_dir: Path, log_dir: Path, agent: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``stargym rollout`` consuming jobs from Redis; measured once it has warmed up. ``engine``
    None: the worker runs the engine in its own process (``--engine-model``, served at /engine).
    ``agent``: every job is that agent's."""
    db.delete(KEYS.jobs)  # the jobs an earlier path left undelivered: this path plays its own only
    feeder = JobFeeder(db, args, agent)
    feeder.top_up()
    worker_args = [
        "rollout", "--env", f"game={env_server.url}", "--tokenizer", str(model_dir),
        "--concurrency", str(args.concurrency), "--shutdown-grace-s", "0", "--run", KEYS.run_id,
    ]  # fmt: skip
    worker_args += ["--engine-url", engine.url] if engine is not None else ["--engine-model", str(model_dir)]
    # The engine in the worker: the engine server's settings, from its variables.
    engine_env = {} if engine is not None else {"STARGYM_THREADS": str(args.threads)}
    with service("worker", worker_args, log_dir, env={"REDIS_URL": redis_url, **engine_env}) as worker:
        engine_url = engine.url if engine is not None else f"{worker.url}{ENGINE_MOUNT}"
        engine_pid = engine.process.pid if engine is not None else worker.process.pid
        pids = {"worker": worker.process.pid, "env_server": env_server.process.pid, "redis": redis_pid}
        if engine is not None:
            pids["engine"] = engine.process.pid
        deadline = time.monotonic() + args.warmup
        while time.monotonic() < deadline:
            feeder.top_up()
            time.sleep(0.25)
        window = Window(engine_url, engine_pid, pids, db)
        deadline = time.monotonic() + args.seconds
        targets = (
            {"engine": engine_pid, "worker": pids["worker"]}
            if engine is not None
            else {IN_WORKER: engine_pid}
        )
        with profiled(targets, min(10.0, args.seconds), args.profile) as profile:
            while time.monotonic() < deadline:
                feeder.top_up()
                window.sample()
                time.sleep(0.25)
            status = httpx.get(f"{worker.url}/status", timeout=10).json()
            measured = window.close()
    trajectories = read_trajectories(db, *measured["redis_ms"])
    result = summarise(trajectories, measured, args.concurrency)
    result["worker_status"] = {
        key: status[key] for key in ("in_flight", "episodes_per_s", "tokens_per_s", "engine_backoffs")
    }
    if profile:
        result["profile"] = profile
    return result


def bench_direct(
    args: argparse.Namespace, db: redis.Redis, engine: ServiceProcess, env_server: ServiceProcess, redis_pid: int,
    model_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """``run_episode`` in ``concurrency`` asyncio tasks of this process: the runner without the queue."""
    from transformers import AutoTokenizer

    from rollout_server.episode import run_episode
    from services.engine_client import EngineClient
    from services.env_client import EnvClient

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pids = {"engine": engine.process.pid, "bench (episodes)": os.getpid(), "env_server": env_server.process.pid,
            "redis": redis_pid}  # fmt: skip

    async def run() -> tuple[list[tuple[float, Trajectory]], dict[str, Any]]:
        async with EnvClient(env_server.url) as envs, EngineClient(engine.url) as engine_client:
            instruction = next(spec.instruction for spec in await envs.list_envs() if spec.id == ENV)
            max_model_len = await engine_client.max_model_len()
            done: list[tuple[float, Trajectory]] = []
            counter = iter(range(10**9))
            stop = asyncio.Event()

            async def player() -> None:
                while not stop.is_set():
                    job = make_job(1_000_000 + next(counter), args.max_turns, args.max_tokens)
                    trajectory = await run_episode(
                        job, envs, engine_client, tokenizer, instruction, 0, max_model_len=max_model_len
                    )
                    done.append((time.perf_counter(), trajectory))

            players = [asyncio.create_task(player()) for _ in range(args.concurrency)]
            await asyncio.sleep(args.warmup)
            window = await asyncio.to_thread(Window, engine.url, engine.process.pid, pids, db)
            started = time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                await asyncio.to_thread(window.sample)
                await asyncio.sleep(0.25)
            measured = await asyncio.to_thread(window.close)
            stop.set()
            await asyncio.gather(*players)
            first, last = measured["span"]
            return [(t, traj) for t, traj in done if first <= t < last], measured

    finished, measured = asyncio.run(run())
    return summarise([trajectory for _, trajectory in finished], measured, args.concurrency)


PROFILED = {
    "engine": ("Engine._prefill_pass", "Engine._decode_step", "Engine._sample", "RequestMetrics.__call__"),
    "worker": (
        "run_episode",
        "EnvClient._request",
        "EngineClient._request",
        "ChatFormat.encode",
        "complete_job",
    ),
}
PROFILED[IN_WORKER] = (*PROFILED["engine"][:3], "run_completion", *PROFILED["worker"])


def py_spy() -> str | None:
    """A ``py-spy`` on the PATH, beside this Python, or in ``$PY_SPY``."""
    import shutil

    for candidate in (
        os.environ.get("PY_SPY"),
        shutil.which("py-spy"),
        str(Path(sys.executable).parent / "py-spy"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@contextmanager
def profiled(pids: dict[str, int], seconds: float, enabled: bool) -> Iterator[dict[str, Any]]:
    """``py-spy record`` of each process while the block runs; the dict gets where its samples were."""
    import subprocess

    report: dict[str, Any] = {}
    binary = py_spy() if enabled else None
    if enabled and binary is None:
        print("--profile: no py-spy (pip install py-spy, or set PY_SPY); not profiling")
    if binary is None:
        yield report
        return
    out = Path(tempfile.mkdtemp(prefix="stargym-profile-"))
    recorders = {}
    for name, pid in pids.items():
        args = ["record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50"]
        args += ["--format", "raw", "--nonblocking", "--output", str(out / f"{name}.txt")]
        recorders[name] = subprocess.Popen(
            [binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    try:
        yield report
    finally:
        for name, recorder in recorders.items():
            recorder.wait(timeout=seconds + 30)
            path = out / f"{name}.txt"
            if path.exists():
                report[name] = sample_shares(path, PROFILED.get(name, ()))


def sample_shares(path: Path, functions: tuple[str, ...]) -> dict[str, Any]:
    """Share of py-spy samples whose stack holds each of ``functions``, and the top leaf frames."""
    total = 0
    inclusive = dict.fromkeys(functions, 0)
    leaves: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        for function in functions:
            if any(frame.startswith(function + " (") for frame in frames):
                inclusive[function] += samples
        leaf = frames[-1].split(":")[0] + ")"
        leaves[leaf] = leaves.get(leaf, 0) + samples
    top = sorted(leaves.items(), key=lambda item: -item[1])[:8]
    return {
        "samples": total,
        "share_in": {name: count / total for name, count in inclusive.items()} if total else {},
        "top_leaf_frames": {name: count / total for name, count in top} if total else {},
    }


# ---- report ---------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    machine = results["machine"]
    table = Table(
        title=f"Rollout: {results['concurrency']} concurrent {ENV} 4x4 episodes, ≤ {results['max_turns']} turns "
        f"({machine['cpus']} cores, load {machine['load_average_before'][0]:.1f} → {machine['load_average_after'][0]:.1f})"
    )
    for column in ("path", "episodes/s", "tokens/s", "env steps/s", "engine util.", "engine thread: on CPU / runq", "in engine", "decode batch",
                   "slots: engine / env / between", "CPU cores: engine / episodes / env", "CPU ms a turn"):  # fmt: skip
        table.add_column(column, justify="right")
    for label, row in results["paths"].items():
        cpu = row["cpu_cores"]
        episodes_cpu = cpu.get("worker", cpu.get("bench (episodes)", 0.0))
        table.add_row(
            label,
            f"{row['episodes_per_s']:.1f}",
            f"{row['engine_tokens_per_s']:,.0f}",
            f"{row['env_steps_per_s']:,.0f}",
            f"{row['engine_utilisation']:.0%}",
            f"{row['engine_thread_on_cpu_share']:.0%} / {row['engine_thread_runqueue_share']:.0%}",
            f"{row['mean_sequences_in_engine']:.1f}" if row["mean_sequences_in_engine"] is not None else "",
            f"{row['mean_decode_batch']:.1f}",
            " / ".join(
                f"{row['episode_slots'][key]:.1f}"
                for key in ("waiting_for_engine", "in_env_calls", "between_episodes")
            ),
            (f"{cpu['engine']:.2f}" if "engine" in cpu else "(in worker)")
            + f" / {episodes_cpu:.2f} / {cpu['env_server']:.2f}",
            f"{rollout_cpu_ms_per_turn(row):.2f}",
        )
    Console(width=170).print(table)
    if results["batched_over_one_prefill_per_pass"] is not None:
        print(f"episodes/s, batched prefill over one prompt per prefill pass: "
              f"{results['batched_over_one_prefill_per_pass']:.2f}x (target {TARGET_SPEEDUP}x)")  # fmt: skip
    ratios = results["engine_in_worker_over_engine_server"]
    if ratios is not None:
        print(f"engine in the worker's process over an engine server: {ratios['cpu_ms_per_turn']:.2f}x the "
              f"rollout CPU a turn, {ratios['episodes_per_s']:.2f}x the episodes/s")  # fmt: skip
    ratios = results["agent_over_worker"]
    if ratios is not None:
        print(f"an openai-client agent over the worker's own episodes: {ratios['cpu_ms_per_turn']:.2f}x the "
              f"rollout CPU a turn, {ratios['episodes_per_s']:.2f}x the episodes/s")  # fmt: skip
    target = results["target"]
    print(f"engine utilisation (worker path) {target['measured']:.0%}, target {target['utilisation']:.0%}: "
          f"{'met' if target['met'] else 'NOT met'}")  # fmt: skip


def rollout_cpu_ms_per_turn(path: dict[str, Any]) -> float:
    """CPU milliseconds of the rollout side (engine, worker, env server) per turn played."""
    cpu = path["cpu_cores"]
    cores = sum(cpu.get(name, 0.0) for name in ("engine", "worker", "bench (episodes)", "env_server"))
    return 1000 * cores / path["turns_per_s"] if path["turns_per_s"] else float("nan")


def over_worker_path(paths: dict[str, dict[str, Any]], label: str) -> dict[str, float] | None:
    """Path ``label``'s rollout CPU a turn and episodes/s over the worker path's on today's engine
    (None when it was skipped)."""
    if label not in paths:
        return None
    served = paths[f"worker, {BATCHED}"]
    return {
        "cpu_ms_per_turn": rollout_cpu_ms_per_turn(paths[label]) / rollout_cpu_ms_per_turn(served),
        "episodes_per_s": paths[label]["episodes_per_s"] / served["episodes_per_s"],
    }


def engine_paths(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The engines measured in turn: the one before batched prefill (the baseline), then today's."""
    paths = [(ONE_PER_PASS, 0)] if args.baseline else []
    return [*paths, (BATCHED, args.prefill_tokens)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8, help="Per turn.")
    parser.add_argument("--seconds", type=float, default=20.0, help="Measured window per path.")
    parser.add_argument("--warmup", type=float, default=5.0, help="Unmeasured seconds before each window.")
    parser.add_argument("--threads", type=int, default=1, help="The engine's torch threads.")
    parser.add_argument("--no-direct", dest="direct", action="store_false", help="Skip the direct path.")
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=2048,
        help="The batched engine's padded tokens per prefill pass.",
    )
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="Skip the engine that prefills one prompt per pass (--prefill-tokens 0), the side-by-side baseline.",
    )
    parser.add_argument(
        "--no-in-worker",
        dest="in_worker",
        action="store_false",
        help="Skip the worker that runs the engine in its own process (--engine-model).",
    )
    parser.add_argument(
        "--no-agent",
        dest="agent",
        action="store_false",
        help=f"Skip the agent path ({AGENT}'s episodes through the recording proxy).",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the engine and the worker in the worker windows."
    )
    parser.add_argument("--check", action="store_true", help="Exit 1 if utilisation misses the target.")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "rollout.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stargym-bench-rollout-") as tmp, ExitStack() as stack:
        log_dir = Path(tmp) / "logs"
        model_dir = init_tiny_model(Path(tmp) / "tiny", 0, [ENV], episodes=100, max_steps=20)
        local_redis = stack.enter_context(start_redis_server())
        assert local_redis.process is not None
        db = stack.enter_context(redis.Redis.from_url(local_redis.url))
        env_server = stack.enter_context(service("env", ["env", "serve", "game"], log_dir))
        paths = {}
        for label, prefill_tokens in engine_paths(args):
            engine_args = ["engine", "serve", "--model", str(model_dir), "--threads", str(args.threads),
                           "--max-num-seqs", str(max(64, args.concurrency)), "--prefill-tokens", str(prefill_tokens)]  # fmt: skip
            with service("engine", engine_args, log_dir) as engine:
                print(f"worker path, {label}: {args.warmup:g} s warm-up, {args.seconds:g} s measured ...")
                paths[f"worker, {label}"] = bench_worker(
                    args, db, local_redis.url, engine, env_server, local_redis.process.pid, model_dir, log_dir
                )
                if args.agent and prefill_tokens:
                    print(f"agent path: {args.warmup:g} s warm-up, {args.seconds:g} s measured ...")
                    paths[AGENT_PATH] = bench_worker(
                        args, db, local_redis.url, engine, env_server, local_redis.process.pid, model_dir,
                        log_dir, agent=AGENT,
                    )  # fmt: skip
                if args.direct and prefill_tokens:
                    print(f"direct path: {args.warmup:g} s warm-up, {args.seconds:g} s measured ...")
                    paths["direct"] = bench_direct(
                        args, db, engine, env_server, local_redis.process.pid, model_dir
                    )
        if args.in_worker:
            print(f"{IN_WORKER}: {args.warmup:g} s warm-up, {args.seconds:g} s measured ...")
            paths[IN_WORKER] = bench_worker(
                args, db, local_redis.url, None, env_server, local_redis.process.pid, model_dir, log_dir
            )
    import torch
    import transformers

    measured = paths[f"worker, {BATCHED}"]["engine_utilisation"]
    speedup = None
    if f"worker, {ONE_PER_PASS}" in paths:
        speedup = (
            paths[f"worker, {BATCHED}"]["episodes_per_s"] / paths[f"worker, {ONE_PER_PASS}"]["episodes_per_s"]
        )
    in_worker = over_worker_path(paths, IN_WORKER)
    agent = over_worker_path(paths, AGENT_PATH)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "env": ENV,
        "options": {"size": 4},
        "concurrency": args.concurrency,
        "max_turns": args.max_turns,
        "max_tokens_per_turn": args.max_tokens,
        "engine_threads": args.threads,
        "model_vocabulary_from": [ENV],
        "seconds_per_window": args.seconds,
        "warmup_seconds": args.warmup,
        "runtime_s": time.perf_counter() - started,
        "paths": paths,
        "prefill_tokens": args.prefill_tokens,
        "batched_over_one_prefill_per_pass": speedup,
        "engine_in_worker_over_engine_server": in_worker,
        "agent_over_worker": agent,
        "target": {"utilisation": TARGET_UTILISATION, "measured": measured, "met": measured >= TARGET_UTILISATION},
    }  # fmt: skip
    render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 1 if args.check and not results["target"]["met"] else 0


if __name__ == "__main__":
    sys.exit(main())
