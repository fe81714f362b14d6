"""Env server benchmark (``make bench``): HTTP steps/s, latency, client CPU and memory, against in-process.

It starts a real env server (``python -m deploy env serve game``) as a subprocess and drives it
from this process through :class:`services.env_client.EnvClient`, as a rollout worker does:

* in-process: the same env stepped in a plain loop, and through the host's ``InstancePool``
  (locks and bookkeeping, no HTTP), as the ceiling HTTP is compared with;
* single steps: 1, 16, 64 and 256 concurrent clients, each an asyncio task owning one instance
  and calling ``POST /instances/{id}/step`` with random actions; finished episodes are reset;
* batched steps: ``POST /instances/step`` with several batch sizes; two requests in flight, so
  that the client builds one batch while the server steps the other;
* memory: the server's RSS (``VmRSS``) with 10,000 live instances.

Client and server share this machine's cores (2 here), so every HTTP number includes the
client's cost; client CPU per step is this process's CPU time over the steps it made, server CPU
per step is read from ``/proc/PID/stat``. Results go to ``bench/results/env_server.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from env_server.core import Env  # noqa: E402
from services.env_client import EnvClient  # noqa: E402

PREFERRED_ENV = "game/frozenlake"
FALLBACK_ENV = "game/bandit"
ENV_PATHS = {
    "game/frozenlake": "env_server.envs.game.frozenlake:FrozenLakeEnv",
    "game/bandit": "env_server.envs.game.bandit:BanditEnv",
}
MAX_EPISODE_STEPS = 100  # a random walk that neither falls nor arrives is reset after this many
CLK_TCK = os.sysconf("SC_CLK_TCK")

# name: (goal, True when more is better)
TARGETS = {
    "single_steps_per_s_at_64": (2000.0, True),
    "batched_steps_per_s": (20000.0, True),
    "p99_ms_at_64": (50.0, False),
    "rss_mib_at_10000": (1024.0, False),
    "client_cpu_ms_per_step": (0.5, False),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_env() -> str:
    """``game/frozenlake``, or ``game/bandit`` while frozenlake is not importable."""
    module = ENV_PATHS[PREFERRED_ENV].partition(":")[0]
    try:
        importlib.import_module(module)
    except ImportError:
        return FALLBACK_ENV
    return PREFERRED_ENV


def load_env_class(env_id: str) -> type[Env]:
    module, _, name = ENV_PATHS[env_id].partition(":")
    return getattr(importlib.import_module(module), name)


def serve_args(env_id: str) -> list[str]:
    """``env serve game`` when the whole family loads; else just the env under test, by path."""
    from env_server.registry import EnvLoadError, load_family

    try:
        load_family("game")
    except (EnvLoadError, ImportError):
        return ["--env", ENV_PATHS[env_id]]
    return ["game"]


class EnvServerProcess:
    """``python -m deploy env serve game`` on a free port, as a context manager."""

    def __init__(self, env_id: str | None = None, max_instances: int = 20000, root: Path = REPO_ROOT) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_instances = max_instances
        self.bench_env = env_id or pick_env()
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> EnvServerProcess:
        self.log_path = Path(tempfile.mkstemp(prefix="bench-env-server-", suffix=".log")[1])
        command = [sys.executable, "-m", "deploy", "env", "serve", *serve_args(self.bench_env)]
        command += ["--port", str(self.port), "--max-instances", str(self.max_instances)]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"env server exited early:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise TimeoutError("env server not healthy after 60 s")

    def rss_bytes(self) -> int:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def cpu_seconds(self) -> float:
        """User plus system CPU time the server process has used so far."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None:
            self.log_path.unlink(missing_ok=True)


def machine_busy_seconds() -> float:
    """CPU time all processes of this machine have used (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass
class Window:
    """Counts what happens between ``start`` and ``stop``: steps, latencies, client and server CPU."""

    server: EnvServerProcess | None = None
    steps: int = 0
    latencies: list[float] = field(default_factory=list)
    counting: bool = False

    def start(self) -> None:
        self.counting = True
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self.server_cpu0 = self.server.cpu_seconds() if self.server else 0.0
        self.machine_cpu0 = machine_busy_seconds()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.wall0
        cpu = time.process_time() - self.cpu0
        server_cpu = (self.server.cpu_seconds() - self.server_cpu0) if self.server else 0.0
        others = machine_busy_seconds() - self.machine_cpu0 - cpu - server_cpu
        self.counting = False
        self.latencies.sort()
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "seconds": round(wall, 3),
            "steps_per_s": self.steps / wall,
            "p50_ms": 1000 * percentile(self.latencies, 0.50),
            "p99_ms": 1000 * percentile(self.latencies, 0.99),
            "client_cpu_ms_per_step": 1000 * cpu / steps,
            "server_cpu_ms_per_step": 1000 * server_cpu / steps,
            # Cores that other processes kept busy meanwhile: high values mean a noisy measurement.
            "other_processes_cores": round(max(0.0, others) / wall, 2),
            "cpu_bound_steps_per_s": cpu_bound_rate(cpu / steps, server_cpu / steps),
        }


def cpu_bound_rate(client_cpu: float, server_cpu: float) -> float:
    """Steps/s this machine's cores would allow the client and server processes if nothing else ran.

    Each is one thread of Python, so each is held to one core, and together to all of them.
    An estimate to read noisy runs by, not a measurement.
    """
    if client_cpu <= 0 or server_cpu <= 0:
        return 0.0
    cores = os.cpu_count() or 1
    return min(1 / client_cpu, 1 / server_cpu, cores / (client_cpu + server_cpu))


# -- in-process ------------------------------------------------------------------------------


def bench_in_process(env_class: type[Env], seconds: float) -> dict[str, float]:
    """The env alone: reset, then random actions, resetting finished episodes, for ``seconds``."""
    env, options, rng = env_class(), env_class.Options(), random.Random(0)
    seed = 0
    env.reset(seed, options)
    actions = env.available_actions() or ["noop"]
    steps = episode_steps = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for _ in range(256):
            result = env.step(rng.choice(actions))
            steps += 1
            episode_steps += 1
            if result.done or episode_steps >= MAX_EPISODE_STEPS:
                seed += 1
                env.reset(seed, options)
                episode_steps = 0
        if time.perf_counter() >= deadline:
            break
    return {"steps_per_s": steps / (time.perf_counter() - started)}


async def bench_in_process_pool(env_class: type[Env], seconds: float) -> dict[str, float]:
    """The host's ``InstancePool`` without HTTP: locks, option handling and bookkeeping included."""
    from env_server.pool import InstancePool

    env_id = env_class.env_id()
    pool = InstancePool({env_id: env_class}, max_instances=10, ttl_s=3600)
    instance, _ = await pool.create(env_id, 0, None)
    actions = instance.env.available_actions() or ["noop"]
    rng = random.Random(0)
    steps = episode_steps = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        for _ in range(256):
            result = await pool.step(instance.instance_id, rng.choice(actions))
            steps += 1
            episode_steps += 1
            if result.done or episode_steps >= MAX_EPISODE_STEPS:
                await pool.reset(instance.instance_id, steps, None)
                episode_steps = 0
    return {"steps_per_s": steps / (time.perf_counter() - started)}


# -- over HTTP -------------------------------------------------------------------------------


@dataclass
class Episode:
    """One instance a client task plays: its id, its action set and its own RNG."""

    instance_id: str
    actions: list[str]
    rng: random.Random
    seed: int
    steps: int = 0


async def make_episodes(client: EnvClient, env_id: str, count: int, first_seed: int) -> list[Episode]:
    semaphore = asyncio.Semaphore(64)

    async def one(seed: int) -> Episode:
        async with semaphore:
            created = await client.create(env_id, seed=seed)
            actions = await client.available_actions(created.instance_id) or ["noop"]
        return Episode(created.instance_id, actions, random.Random(seed), seed)

    return list(await asyncio.gather(*(one(first_seed + i) for i in range(count))))


async def close_episodes(client: EnvClient, episodes: list[Episode]) -> None:
    semaphore = asyncio.Semaphore(64)

    async def one(episode: Episode) -> None:
        async with semaphore:
            await client.close(episode.instance_id)

    await asyncio.gather(*(one(e) for e in episodes))


async def restart(client: EnvClient, episode: Episode) -> None:
    episode.seed += 100_003
    episode.steps = 0
    await client.reset(episode.instance_id, seed=episode.seed)


async def bench_single(
    client: EnvClient, server: EnvServerProcess, env_id: str, concurrency: int, seconds: float
) -> dict[str, float]:
    episodes = await make_episodes(client, env_id, concurrency, first_seed=concurrency * 1000)
    window = Window(server)
    stop_at = 0.0

    async def play(episode: Episode) -> None:
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return
            result = await client.step(episode.instance_id, episode.rng.choice(episode.actions))
            if window.counting:
                window.latencies.append(time.perf_counter() - started)
                window.steps += 1
            episode.steps += 1
            if result.done or episode.steps >= MAX_EPISODE_STEPS:
                await restart(client, episode)

    stop_at = time.perf_counter() + min(1.0, seconds / 3)  # warm-up: connections open, code hot
    await asyncio.gather(*(play(e) for e in episodes))
    window.start()
    stop_at = time.perf_counter() + seconds
    await asyncio.gather(*(play(e) for e in episodes))
    result = window.stop()
    await close_episodes(client, episodes)
    return {"concurrency": concurrency, **result}


async def bench_batched(
    client: EnvClient,
    server: EnvServerProcess,
    env_id: str,
    batch_size: int,
    seconds: float,
    in_flight: int = 2,
) -> dict[str, float]:
    """``in_flight`` batches of ``batch_size`` instances each, stepped over and over.

    Finished episodes are reset between batches with single resets (there is no batched reset).
    Two rates come out: ``steps_per_s``, steps per second of wall time during which at least one
    batched request was in flight (the route's own rate), and ``steps_per_s_with_resets``, steps
    over the whole wall time.
    """
    groups = [
        await make_episodes(client, env_id, batch_size, first_seed=batch_size * 1000 + g * batch_size)
        for g in range(in_flight)
    ]
    window = Window(server)
    busy = {"requests": 0, "since": 0.0, "seconds": 0.0}
    stop_at = 0.0

    async def drive(episodes: list[Episode]) -> None:
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return
            if busy["requests"] == 0:
                busy["since"] = started
            busy["requests"] += 1
            outcomes = await client.step_many([(e.instance_id, e.rng.choice(e.actions)) for e in episodes])
            ended = time.perf_counter()
            busy["requests"] -= 1
            if busy["requests"] == 0 and window.counting:
                busy["seconds"] += ended - max(busy["since"], window.wall0)
            finished = []
            for episode, outcome in zip(episodes, outcomes, strict=True):
                if outcome.result is None:
                    raise RuntimeError(f"batched step failed: {outcome.error}")
                episode.steps += 1
                if outcome.result.done or episode.steps >= MAX_EPISODE_STEPS:
                    finished.append(episode)
            if window.counting:
                window.latencies.append(ended - started)
                window.steps += len(outcomes)
            await asyncio.gather(*(restart(client, e) for e in finished))

    stop_at = time.perf_counter() + min(1.0, seconds / 3)
    await asyncio.gather(*(drive(g) for g in groups))
    window.start()
    stop_at = time.perf_counter() + seconds
    await asyncio.gather(*(drive(g) for g in groups))
    result = window.stop()
    result["steps_per_s_with_resets"] = result.pop("steps_per_s")
    result["steps_per_s"] = result["steps"] / busy["seconds"] if busy["seconds"] else 0.0
    result["seconds_in_route"] = round(busy["seconds"], 3)
    for group in groups:
        await close_episodes(client, group)
    return {"batch_size": batch_size, "in_flight": in_flight, **result}


async def bench_memory(
    client: EnvClient, server: EnvServerProcess, env_id: str, count: int
) -> dict[str, Any]:
    before = server.rss_bytes()
    semaphore = asyncio.Semaphore(64)

    async def one(seed: int) -> None:
        async with semaphore:
            await client.create(env_id, seed=seed)

    started = time.perf_counter()
    await asyncio.gather(*(one(seed) for seed in range(count)))
    create_seconds = time.perf_counter() - started
    after = server.rss_bytes()
    return {
        "instances": count,
        "rss_mib": after / 2**20,
        "rss_mib_before": before / 2**20,
        "kib_per_instance": (after - before) / 1024 / count,
        "creates_per_s": count / create_seconds,
    }


# -- the run ---------------------------------------------------------------------------------


async def run(args: argparse.Namespace, server: EnvServerProcess, env_class: type[Env]) -> dict[str, Any]:
    env_id = server.bench_env
    results: dict[str, Any] = {"single": [], "batched": []}
    results["in_process"] = bench_in_process(env_class, args.seconds / 2)
    results["in_process_pool"] = await bench_in_process_pool(env_class, args.seconds / 2)
    async with EnvClient(server.url, timeout=60.0) as client:
        # Memory first, on a server that has held nothing yet; the instances stay alive for the
        # throughput runs, as a busy server's would.
        results["memory"] = await bench_memory(client, server, env_id, args.instances)
        print_memory(results["memory"])
        for concurrency in args.concurrency:
            results["single"].append(await bench_single(client, server, env_id, concurrency, args.seconds))
            print_row("single", results["single"][-1])
        for batch_size in args.batch_sizes:
            results["batched"].append(await bench_batched(client, server, env_id, batch_size, args.seconds))
            print_row("batched", results["batched"][-1])
    return results


def print_memory(memory: dict[str, Any]) -> None:
    print(
        f"  server RSS with {memory['instances']:,} live instances: {memory['rss_mib']:.0f} MiB "
        f"({memory['kib_per_instance']:.1f} KiB each over {memory['rss_mib_before']:.0f} MiB idle; "
        f"{memory['creates_per_s']:,.0f} creates/s)",
        flush=True,
    )


def print_row(kind: str, row: dict[str, float]) -> None:
    size = f"clients {row['concurrency']}" if kind == "single" else f"batch {row['batch_size']}"
    with_resets = f" ({row['steps_per_s_with_resets']:.0f} with resets)" if kind == "batched" else ""
    print(
        f"  {kind:8} {size:12} {row['steps_per_s']:9.0f} steps/s{with_resets}  p50 {row['p50_ms']:6.2f} ms  "
        f"p99 {row['p99_ms']:6.2f} ms  client {row['client_cpu_ms_per_step']:.3f} ms/step  "
        f"server {row['server_cpu_ms_per_step']:.3f} ms/step  "
        f"(other processes: {row['other_processes_cores']:.1f} cores)",
        flush=True,
    )


def check_targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    at_64 = next((r for r in results["single"] if r["concurrency"] == 64), None)
    best_batched = max((r["steps_per_s"] for r in results["batched"]), default=0.0)
    client_cpu = max(
        (r["client_cpu_ms_per_step"] for r in results["single"] if r["concurrency"] > 1), default=0.0
    )
    measured = {
        "single_steps_per_s_at_64": at_64["steps_per_s"] if at_64 else None,
        "batched_steps_per_s": best_batched,
        "p99_ms_at_64": at_64["p99_ms"] if at_64 else None,
        "rss_mib_at_10000": results["memory"]["rss_mib"] if results["memory"]["instances"] >= 10000 else None,
        "client_cpu_ms_per_step": client_cpu,
    }
    checks = {}
    for name, (target, more_is_better) in TARGETS.items():
        value = measured[name]
        met = None if value is None else (value >= target if more_is_better else value <= target)
        checks[name] = {"target": target, "measured": value, "met": met}
    return checks


def render(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    in_process = results["in_process"]["steps_per_s"]
    table = Table(
        title=f"env server: {results['env']}, {results['machine']['cpus']} cores shared by client and server",
        caption="single: POST /instances/{id}/step, one request per step; "
        "batched: POST /instances/step, batch size × requests in flight, steps per second of wall time "
        "with a batch in flight (finished episodes are reset in between)",
    )
    columns = ["route", "clients / batch", "steps/s", "× in-process", "p50 ms", "p99 ms"]
    columns += ["client CPU ms/step", "server CPU ms/step", "other procs (cores)", "CPU-bound est. steps/s"]
    for column in columns:
        table.add_column(column, justify="left" if column == "route" else "right")
    pool_rate = results["in_process_pool"]["steps_per_s"]
    table.add_row("in-process env", "1", f"{in_process:,.0f}", "1")
    table.add_row("in-process pool", "1", f"{pool_rate:,.0f}", f"{pool_rate / in_process:.3f}")
    for kind in ("single", "batched"):
        for row in results[kind]:
            size = str(row["concurrency"]) if kind == "single" else f"{row['batch_size']} ×{row['in_flight']}"
            table.add_row(
                kind,
                size,
                f"{row['steps_per_s']:,.0f}",
                f"{row['ratio_to_in_process']:.3f}",
                f"{row['p50_ms']:.2f}",
                f"{row['p99_ms']:.2f}",
                f"{row['client_cpu_ms_per_step']:.3f}",
                f"{row['server_cpu_ms_per_step']:.3f}",
                f"{row['other_processes_cores']:.1f}",
                f"{row['cpu_bound_steps_per_s']:,.0f}",
            )
    console.print(table)
    print_memory(results["memory"])
    busiest = max(row["other_processes_cores"] for row in results["single"] + results["batched"])
    if busiest > 0.3:
        console.print(
            f"[yellow]other processes kept up to {busiest:.1f} cores busy during the runs: steps/s and "
            "latencies are lower than on an idle machine (CPU per step is not affected much)."
        )
    targets = Table(title="targets")
    for column in ("target", "goal", "measured", "met"):
        targets.add_column(column)
    for name, check in results["targets"].items():
        value = check["measured"]
        shown = "n/a" if value is None else f"{value:,.3f}" if value < 10 else f"{value:,.0f}"
        mark = "[green]yes" if check["met"] else "[red]no" if check["met"] is False else "n/a"
        targets.add_row(name, f"{check['target']:,}", shown, mark)
    console.print(targets)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--env", choices=sorted(ENV_PATHS), help="Default: game/frozenlake (bandit if missing)."
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="Measured time per configuration.")
    parser.add_argument("--concurrency", type=_ints, default=[1, 16, 64, 256])
    parser.add_argument("--batch-sizes", type=_ints, default=[16, 64, 256, 1024])
    parser.add_argument("--instances", type=int, default=10_000, help="Live instances for the memory check.")
    parser.add_argument("--uvloop", action="store_true", help="Run the client on uvloop.")
    parser.add_argument("--check", action="store_true", help="Exit 1 if a target is missed.")
    parser.add_argument(
        "--server-root",
        type=Path,
        default=REPO_ROOT,
        help="Run the server from another checkout (a git worktree of an older commit) to compare.",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "env_server.json")
    return parser.parse_args()


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> int:
    args = parse_args()
    import aiohttp

    load_before = os.getloadavg()
    max_instances = max(20000, args.instances + 2000)
    with EnvServerProcess(args.env, max_instances, args.server_root.resolve()) as server:
        env_class = load_env_class(server.bench_env)
        print(f"benchmarking {server.bench_env} on {server.url} ({args.seconds:g} s per configuration)")
        if args.uvloop:
            import uvloop

            results = uvloop.run(run(args, server, env_class))
        else:
            results = asyncio.run(run(args, server, env_class))
    in_process = results["in_process"]["steps_per_s"]
    for row in results["single"] + results["batched"]:
        row["ratio_to_in_process"] = row["steps_per_s"] / in_process
    results = {
        "env": server.bench_env,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "client": {
            "library": f"aiohttp {aiohttp.__version__}",
            "loop": "uvloop" if args.uvloop else "asyncio",
        },
        "server_root": str(args.server_root.resolve()),
        "seconds_per_configuration": args.seconds,
        "ratio_note": "HTTP steps/s divided by the env stepped in a plain loop in this process",
        **results,
    }
    results["targets"] = check_targets(results)
    render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    missed = [name for name, check in results["targets"].items() if check["met"] is False]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
