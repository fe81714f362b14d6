"""Env server benchmark (``make bench``): HTTP steps/s, latency, client CPU and memory, against in-process.

``--family game`` (and ``all``, the default) starts a real env server (``python -m deploy env serve
game``) as a subprocess and drives it from this process through
:class:`services.env_client.EnvClient`, as a rollout worker does:

* in-process: the same env stepped in a plain loop, and through the host's ``InstancePool``
  (locks and bookkeeping, no HTTP), as the ceiling HTTP is compared with;
* single steps: 1, 16, 64 and 256 concurrent clients, each an asyncio task owning one instance
  and calling ``POST /instances/{id}/step`` with random actions; finished episodes are reset;
* batched steps: ``POST /instances/step`` with several batch sizes; two requests in flight, so
  that the client builds one batch while the server steps the other;
* memory: the server's RSS (``VmRSS``) with 10,000 live instances;
* OpenEnv sessions: 1 and 16 clients, each an OpenEnv WebSocket session (``/openenv/<env>/ws``,
  env_server/openenv.py) playing the same way, one step message per step.

Client and server share this machine's cores (2 here), so every HTTP number includes the
client's cost; client CPU per step is this process's CPU time over the steps it made, server CPU
per step is read from ``/proc/PID/stat``. Results go to ``bench/results/env_server.json``.

``--family embodied`` (and ``all``) serves ``embodied`` (BabyAI and ScienceWorld on one server),
its SciWorld JVM pool sized for one JVM per client, and measures each env against the same env in
this process (ScienceWorld on a private pool of one JVM):

* reset and step latency, one client: resets over a fixed list of seeds; steps of random valid
  actions from ``available_actions`` (re-read after every step, as a rollout worker does),
  finished episodes reset; for SciWorld also a reset on a fresh JVM (an instance's create on an
  empty pool slot) and steps without action hints (a fixed list of cheap actions);
* steps/s at 16 clients, each an instance of its own, playing the same way;
* the JVM pool under load: 32 concurrent SciWorld episodes on a second server whose pool holds 4
  JVMs: all finish, wall time, the wait of each create, java processes during and after, 429s.

A JVM is a child of the server, so the server's CPU per step includes its JVMs'. Results go to
``bench/results/env_server_embodied.json``.

``--family search`` (and ``all``) measures ``search/searchqa`` on its default facts corpus:

* load time of the dataset and its tantivy index, in this process and as a server's start (spawn
  to healthy: ``prepare`` loads them before the server listens), cold (an empty cache folder:
  the facts generated, the index built) and warm (both read back from the cache);
* the retriever alone in this process: top-3 queries/s over the single-hop questions' texts;
* steps with 1 and 16 clients, each an instance of its own: 9 replies in 10 a search for the
  instance's question, 1 a wrong answer (which continues the episode), reset after the env's
  turn limit; against the same play in this process.

The cache folders are temporary, so the cold numbers are cold in files (no dataset, no index),
not in the OS's page cache of the source packages. Results go to ``bench/results/env_server_search.json``.

``--family web`` (and ``all``) measures ``web/shop`` on its generated catalog:

* the catalog's generation and its index (in memory) in this process; the server's start, cold
  (an empty cache folder) and warm (the index read back), and its RSS;
* search and click latency, one client, in-process and over HTTP: a search from the search page,
  a click on its first product, a click on "Back to Search", in turn; and GETs of a results
  page's HTML, as a person's browser makes them;
* steps/s with 1 and 16 clients (random clickables, a search where there is a search bar, reset
  after 15 turns) against the same play in this process.

Results go to ``bench/results/env_server_web.json``.

``--family reasoning`` and ``--family textarena`` (and ``all``) each measure one env of the family,
``reasoning/basic_arithmetic`` (one answer an episode, from a fixed list, so every step is followed
by a reset) and ``textarena/guess_the_number`` (random guesses of the 20 listed, reset after its 10
turns): the server's start and RSS, and steps/s with 1 and 16 clients against the same play in this
process. Results go to ``bench/results/env_server_<family>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from env_server.core import Env  # noqa: E402
from services.env_client import EnvClient, EnvServerError  # noqa: E402

if TYPE_CHECKING:
    from env_server.envs.search.facts import Dataset
    from env_server.envs.search.retriever import Retriever

PREFERRED_ENV = "game/frozenlake"
FALLBACK_ENV = "game/bandit"
ENV_PATHS = {
    "game/frozenlake": "env_server.envs.game.frozenlake:FrozenLakeEnv",
    "game/bandit": "env_server.envs.game.bandit:BanditEnv",
    "embodied/babyai": "env_server.envs.embodied.babyai:BabyAIEnv",
    "embodied/sciworld": "env_server.envs.embodied.sciworld:SciWorldEnv",
    "search/searchqa": "env_server.envs.search.searchqa:SearchQAEnv",
    "web/shop": "env_server.envs.web.shop:ShopEnv",
    "reasoning/basic_arithmetic": "env_server.envs.reasoning.hosted:BasicArithmeticEnv",
    "textarena/guess_the_number": "env_server.envs.textarena.hosted:TextArenaGuessTheNumberEnv",
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
    """``env serve FAMILY`` (the env's) when the whole family loads; else just the env under test, by path."""
    from env_server.registry import EnvLoadError, load_family

    family = env_id.partition("/")[0]
    try:
        load_family(family)
    except (EnvLoadError, ImportError):
        return ["--env", ENV_PATHS[env_id]]
    return [family]


class EnvServerProcess:
    """``python -m deploy env serve FAMILY`` on a free port, as a context manager.

    ``environ``: variables added to the server's environment (``STARGYM_SCIWORLD_POOL_SIZE``).
    """

    def __init__(
        self,
        env_id: str | None = None,
        max_instances: int = 20000,
        root: Path = REPO_ROOT,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_instances = max_instances
        self.bench_env = env_id or pick_env()
        self.environ = {**os.environ, **(environ or {})}
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """What starts the server, before its port and instance limit."""
        return [sys.executable, "-m", "deploy", "env", "serve", *serve_args(self.bench_env)]

    def __enter__(self) -> EnvServerProcess:
        self.log_path = Path(tempfile.mkstemp(prefix="bench-env-server-", suffix=".log")[1])
        command = [*self.command(), "--port", str(self.port), "--max-instances", str(self.max_instances)]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, env=self.environ
            )
        started = time.monotonic()
        deadline = started + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"env server exited early:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        self.start_s = time.monotonic() - started  # from spawn to the first healthy answer
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
        """User plus system CPU time the server process and its live children (JVMs) have used so far."""
        assert self.process is not None
        stats = [proc_stat(self.process.pid), *self.children().values()]
        return sum(int(fields[11]) + int(fields[12]) for _, fields in stats if fields) / CLK_TCK

    def children(self) -> dict[int, tuple[str, list[str]]]:
        """The server's live (not zombie) child processes by pid: name and ``/proc/PID/stat`` fields.

        A child is listed under the thread that started it, and JVMs start on worker threads.
        """
        assert self.process is not None
        pids: set[int] = set()
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids.update(int(pid) for pid in (task / "children").read_text().split())
        stats = {pid: proc_stat(pid) for pid in pids}
        return {pid: stat for pid, stat in stats.items() if stat[1] and stat[1][0] != "Z"}

    def java_processes(self) -> set[int]:
        return {pid for pid, (name, _) in self.children().items() if name == "java"}

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


def proc_stat(pid: int) -> tuple[str, list[str]]:
    """A process's name and the fields of ``/proc/PID/stat`` after it (state first); none once it is gone."""
    try:
        head, _, tail = Path(f"/proc/{pid}/stat").read_text().rpartition(")")
    except OSError:
        return "", []
    return head.partition("(")[2], tail.split()


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


@dataclass(frozen=True)
class Policy:
    """How a client plays: the instance's options, when an episode is cut short, and its actions.

    ``actions`` given: random ones of that list. ``from_observation`` given: random ones of what it
    makes of the observation of each create and reset (search: the question). Otherwise random ones
    of ``available_actions``, read once (``refresh`` False: the game envs' action sets do not
    change) or after every step.
    """

    options: dict[str, Any] | None = None
    max_steps: int = MAX_EPISODE_STEPS
    actions: tuple[str, ...] | None = None
    refresh: bool = False
    from_observation: Callable[[str], tuple[str, ...]] | None = None
    open_text: tuple[str, ...] = ()  # where the env lists no actions (a search page): random ones of these


@dataclass
class Episode:
    """One instance a client task plays: its id, its action set, its own RNG and how it plays."""

    instance_id: str
    actions: list[str]
    rng: random.Random
    seed: int
    policy: Policy = Policy()
    create_s: float = 0.0  # how long its create took
    steps: int = 0


async def make_episodes(
    client: EnvClient,
    env_id: str,
    count: int,
    first_seed: int,
    policy: Policy = Policy(),
    parallel: int = 64,
) -> list[Episode]:
    """``count`` instances, created ``parallel`` at a time."""
    semaphore = asyncio.Semaphore(parallel)

    async def one(seed: int) -> Episode:
        async with semaphore:
            started = time.perf_counter()
            created = await client.create(env_id, seed=seed, options=policy.options)
            create_s = time.perf_counter() - started
            episode = Episode(created.instance_id, [], random.Random(seed), seed, policy, create_s)
            if policy.from_observation:
                episode.actions = list(policy.from_observation(created.observation))
            else:
                await read_actions(client, episode)
        return episode

    return list(await asyncio.gather(*(one(first_seed + i) for i in range(count))))


async def read_actions(client: EnvClient, episode: Episode) -> None:
    fixed = episode.policy.actions
    episode.actions = (
        list(fixed)
        if fixed
        else await client.available_actions(episode.instance_id) or list(episode.policy.open_text) or ["noop"]
    )


async def close_episodes(client: EnvClient, episodes: list[Episode]) -> None:
    semaphore = asyncio.Semaphore(64)

    async def one(episode: Episode) -> None:
        async with semaphore:
            await client.close(episode.instance_id)

    await asyncio.gather(*(one(e) for e in episodes))


async def restart(client: EnvClient, episode: Episode) -> None:
    episode.seed += 100_003
    episode.steps = 0
    observed = await client.reset(episode.instance_id, seed=episode.seed)
    if episode.policy.from_observation:
        episode.actions = list(episode.policy.from_observation(observed.observation))
    elif episode.policy.refresh:
        await read_actions(client, episode)


async def bench_single(
    client: EnvClient, server: EnvServerProcess, episodes: list[Episode], seconds: float
) -> dict[str, float]:
    """Each episode a client task stepping its instance; the episodes are closed at the end."""
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
            if result.done or episode.steps >= episode.policy.max_steps:
                await restart(client, episode)
            elif episode.policy.refresh:
                await read_actions(client, episode)

    stop_at = time.perf_counter() + min(1.0, seconds / 3)  # warm-up: connections open, code hot
    await asyncio.gather(*(play(e) for e in episodes))
    window.start()
    stop_at = time.perf_counter() + seconds
    await asyncio.gather(*(play(e) for e in episodes))
    result = window.stop()
    await close_episodes(client, episodes)
    return {"concurrency": len(episodes), **result}


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
    results: dict[str, Any] = {"single": [], "batched": [], "openenv": []}
    results["in_process"] = bench_in_process(env_class, args.seconds / 2)
    results["in_process_pool"] = await bench_in_process_pool(env_class, args.seconds / 2)
    async with EnvClient(server.url, timeout=60.0) as client:
        # Memory first, on a server that has held nothing yet; the instances stay alive for the
        # throughput runs, as a busy server's would.
        results["memory"] = await bench_memory(client, server, env_id, args.instances)
        print_memory(results["memory"])
        for concurrency in args.concurrency:
            episodes = await make_episodes(client, env_id, concurrency, first_seed=concurrency * 1000)
            results["single"].append(await bench_single(client, server, episodes, args.seconds))
            print_row("single", results["single"][-1])
        for batch_size in args.batch_sizes:
            results["batched"].append(await bench_batched(client, server, env_id, batch_size, args.seconds))
            print_row("batched", results["batched"][-1])
        actions = (await make_episodes(client, env_id, 1, first_seed=0))[0].actions
    for concurrency in args.openenv_concurrency:
        results["openenv"].append(await bench_openenv(server, actions, concurrency, args.seconds))
        print_row("openenv", results["openenv"][-1])
    return results


async def bench_openenv(
    server: EnvServerProcess, actions: list[str], concurrency: int, seconds: float
) -> dict[str, float]:
    """Each client an OpenEnv WebSocket session (``/openenv/<env>/ws``) playing random actions,
    a new episode (reset with the next seed) when one ends: the same play as :func:`bench_single`."""
    from websockets.asyncio.client import connect

    url = server.url.replace("http://", "ws://") + f"/openenv/{server.bench_env}/ws"
    window = Window(server)
    stop_at = 0.0

    async def play(ws: Any, rng: random.Random) -> None:
        seed = rng.randrange(2**31)
        steps = 0
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            await ws.send(json.dumps({"type": "step", "data": {"text": rng.choice(actions)}}))
            answer = json.loads(await ws.recv())
            if answer["type"] != "observation":
                raise RuntimeError(f"OpenEnv step failed: {answer['data']}")
            if window.counting:
                window.latencies.append(time.perf_counter() - started)
                window.steps += 1
            steps += 1
            if answer["data"]["done"] or steps >= MAX_EPISODE_STEPS:
                seed += 100_003
                steps = 0
                await ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
                await ws.recv()

    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(connect(url)) for _ in range(concurrency)]
        for seed, ws in enumerate(sessions):
            await ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
            await ws.recv()
        rngs = [random.Random(seed) for seed in range(concurrency)]
        stop_at = time.perf_counter() + min(1.0, seconds / 3)  # warm-up
        await asyncio.gather(*map(play, sessions, rngs))
        window.start()
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*map(play, sessions, rngs))
        result = window.stop()
    return {"concurrency": concurrency, **result}


def print_memory(memory: dict[str, Any]) -> None:
    print(
        f"  server RSS with {memory['instances']:,} live instances: {memory['rss_mib']:.0f} MiB "
        f"({memory['kib_per_instance']:.1f} KiB each over {memory['rss_mib_before']:.0f} MiB idle; "
        f"{memory['creates_per_s']:,.0f} creates/s)",
        flush=True,
    )


def print_row(kind: str, row: dict[str, float]) -> None:
    size = f"batch {row['batch_size']}" if kind == "batched" else f"clients {row['concurrency']}"
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


def wide_console() -> Any:
    """rich's console; 160 columns when the output is not a terminal (a log), so tables don't wrap."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def render(results: dict[str, Any]) -> None:
    from rich.table import Table

    console = wide_console()
    in_process = results["in_process"]["steps_per_s"]
    table = Table(
        title=f"env server: {results['env']}, {results['machine']['cpus']} cores shared by client and server",
        caption="single: POST /instances/{id}/step, one request per step; "
        "batched: POST /instances/step, batch size × requests in flight, steps per second of wall time "
        "with a batch in flight (finished episodes are reset in between); openenv: one OpenEnv "
        "WebSocket session per client, a step message per step",
    )
    columns = ["route", "clients / batch", "steps/s", "× in-process", "p50 ms", "p99 ms"]
    columns += ["client CPU ms/step", "server CPU ms/step", "other procs (cores)", "CPU-bound est. steps/s"]
    for column in columns:
        table.add_column(column, justify="left" if column == "route" else "right")
    pool_rate = results["in_process_pool"]["steps_per_s"]
    table.add_row("in-process env", "1", f"{in_process:,.0f}", "1")
    table.add_row("in-process pool", "1", f"{pool_rate:,.0f}", f"{pool_rate / in_process:.3f}")
    for kind in ("single", "batched", "openenv"):
        for row in results[kind]:
            size = (
                f"{row['batch_size']} ×{row['in_flight']}" if kind == "batched" else str(row["concurrency"])
            )
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
    busiest = max(
        row["other_processes_cores"] for row in results["single"] + results["batched"] + results["openenv"]
    )
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


# -- embodied --------------------------------------------------------------------------------

EMBODIED_ENVS = ("embodied/babyai", "embodied/sciworld")
EMBODIED_OPTIONS: dict[str, dict[str, Any]] = {
    # AgentGym's 40 levels, the GPU recipe's mix: the seed picks the level and its layout, so a
    # reset builds a new minigrid env whenever the level changes, as in training.
    "embodied/babyai": {"level": "agentgym"},
    # The seed picks one of the 30 tasks; action hints on (the default), as a policy that chooses
    # from available_actions needs.
    "embodied/sciworld": {},
}
RESET_SAMPLES = {"embodied/babyai": 100, "embodied/sciworld": 20}
# Valid anywhere, and neither scoring nor ending an episode (checked: 40 of them in each of the 30
# tasks): the steps without action hints play these, so that they differ from the steps with
# hints by the hints alone.
SCIWORLD_FIXED_ACTIONS = ("look around", "inventory", "task", "wait1")
# A JVM starts in ~1 s and takes ~0.5 GB: three fresh starts in-process are enough to compare with.
FRESH_JVM_SAMPLES_IN_PROCESS = 3
# The pool run's episodes: AgentGym-RL's first SciWorld horizon (10/20/30 turns).
POOL_EPISODE_TURNS = 10


def latency(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "p50_ms": 1000 * percentile(ordered, 0.50),
        "p99_ms": 1000 * percentile(ordered, 0.99),
    }


def compared(in_process: dict[str, float], http: dict[str, float]) -> dict[str, Any]:
    """A latency in-process and over HTTP; the ratio of their medians."""
    return {"in_process": in_process, "http": http, "ratio_p50": http["p50_ms"] / in_process["p50_ms"]}


@contextlib.contextmanager
def in_process_env(env_id: str) -> Iterator[Env]:
    """The env in this process; SciWorld on a private pool of one JVM, ended on exit."""
    env_class = load_env_class(env_id)
    if env_id != "embodied/sciworld":
        env = env_class()
        try:
            yield env
        finally:
            env.close()
        return
    from env_server.envs.embodied.jvm_pool import JvmPool, JvmPoolSettings

    pool = JvmPool(JvmPoolSettings(pool_size=1))
    env = env_class(pool)
    try:
        yield env
    finally:
        env.close()
        pool.shutdown()


def resets_in_process(env: Env, options: dict[str, Any], seeds: range) -> list[float]:
    parsed = env.Options.model_validate(options)
    seconds = []
    for seed in seeds:
        started = time.perf_counter()
        env.reset(seed, parsed)
        seconds.append(time.perf_counter() - started)
    return seconds


def fresh_jvm_resets_in_process(options: dict[str, Any], seeds: range) -> list[float]:
    """Each reset on a new pool: its lease starts a JVM, then loads the task, as a create on an empty slot."""
    seconds = []
    for seed in seeds:
        with in_process_env("embodied/sciworld") as env:
            seconds += resets_in_process(env, options, range(seed, seed + 1))
    return seconds


def play_in_process(env: Env, policy: Policy, seconds: float) -> dict[str, float]:
    """One client's play (see :class:`Policy`) without HTTP: step latencies, and steps/s with the
    resets of finished episodes in the wall time, as :func:`bench_single` measures over HTTP."""
    options, rng, seed = env.Options.model_validate(policy.options or {}), random.Random(0), 0
    observation = env.reset(seed, options).observation
    latencies: list[float] = []
    episode_steps = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        if policy.from_observation:
            actions = list(policy.from_observation(observation))
        else:
            actions = policy.actions or env.available_actions() or list(policy.open_text) or ["noop"]
        before = time.perf_counter()
        result = env.step(rng.choice(actions))
        latencies.append(time.perf_counter() - before)
        episode_steps += 1
        if result.done or episode_steps >= policy.max_steps:
            seed += 100_003
            observation = env.reset(seed, options).observation
            episode_steps = 0
    return {
        "steps": len(latencies),
        "steps_per_s": len(latencies) / (time.perf_counter() - started),
    } | latency(latencies)


async def resets_over_http(client: EnvClient, instance_id: str, seeds: range) -> list[float]:
    seconds = []
    for seed in seeds:
        started = time.perf_counter()
        await client.reset(instance_id, seed=seed)
        seconds.append(time.perf_counter() - started)
    return seconds


async def bench_embodied_env(
    client: EnvClient, server: EnvServerProcess, env_id: str, clients: int, seconds: float
) -> dict[str, Any]:
    """Latencies and steps/s of one embodied env, in-process and over HTTP."""
    options = EMBODIED_OPTIONS[env_id]
    sciworld = env_id == "embodied/sciworld"
    policy = Policy(options, load_env_class(env_id).default_max_turns, refresh=True)
    seeds = range(RESET_SAMPLES[env_id])
    results: dict[str, Any] = {"options": options, "max_turns": policy.max_steps}
    print(f"  {env_id}: {clients} instances", flush=True)
    # Created one at a time on the server's empty JVM pool: each create starts a JVM.
    episodes = await make_episodes(client, env_id, clients, 1000, policy, parallel=1 if sciworld else 64)
    fresh_http = [episode.create_s for episode in episodes]
    # Each of these JVMs has answered one reset and JIT-compiles the simulator on its own, so a
    # step costs them more CPU than the warm JVM of the one-client runs: in a probe, SciWorld's
    # server CPU per step at 16 clients fell from 129 to 111 to 93 ms over three 6 s windows.
    results["clients"] = await bench_single(client, server, episodes, seconds)
    print(f"  {env_id}: in-process", flush=True)
    with in_process_env(env_id) as env:
        resets_in_process(env, options, range(1))  # SciWorld's JVM starts here, as a create's does
        reset_in_process = latency(resets_in_process(env, options, seeds))
        step_in_process = play_in_process(env, policy, seconds)
        if sciworld:
            fixed = Policy({**options, "action_hints": False}, policy.max_steps, SCIWORLD_FIXED_ACTIONS)
            fixed_in_process = play_in_process(env, fixed, seconds)
    print(f"  {env_id}: one client over HTTP", flush=True)
    (episode,) = await make_episodes(client, env_id, 1, 0, policy)
    reset_http = latency(await resets_over_http(client, episode.instance_id, seeds))
    step_http = await bench_single(client, server, [episode], seconds)
    results["reset"] = compared(reset_in_process, reset_http)
    results["step"] = compared(step_in_process, step_http)
    results["in_process_steps_per_s"] = step_in_process["steps_per_s"]
    for row in (step_http, results["clients"]):
        row["ratio_to_in_process"] = row["steps_per_s"] / step_in_process["steps_per_s"]
    if sciworld:
        fresh_in_process = fresh_jvm_resets_in_process(options, range(FRESH_JVM_SAMPLES_IN_PROCESS))
        results["reset_fresh_jvm"] = compared(latency(fresh_in_process), latency(fresh_http))
        episodes = await make_episodes(client, env_id, 1, 0, fixed)
        results["step_without_hints"] = compared(
            fixed_in_process, await bench_single(client, server, episodes, seconds)
        )
    return results


async def bench_jvm_pool(
    client: EnvClient, server: EnvServerProcess, instances: int, pool_size: int
) -> dict[str, Any]:
    """``instances`` concurrent SciWorld episodes of random valid actions on a pool of ``pool_size`` JVMs.

    A create waits for a free JVM; a 429 (no JVM came free within the server's acquire deadline)
    is counted and the create sent again. Each create's wait is its latency minus a reset of the
    same task on the JVM it got, which is warm by then: the time it queued, or for the creates
    that found an empty slot, their JVM's start.
    """
    env_id = "embodied/sciworld"
    options = EMBODIED_OPTIONS[env_id]
    seen: list[set[int]] = []
    refused = 0
    finished = asyncio.Event()

    async def sample() -> None:
        while not finished.is_set():
            seen.append(server.java_processes())
            await asyncio.sleep(0.05)

    async def episode(seed: int) -> tuple[float, float, int]:
        nonlocal refused
        started = time.perf_counter()
        while True:
            try:
                created = await client.create(env_id, seed=seed, options=options)
                break
            except EnvServerError as error:
                if error.status != 429:
                    raise
                refused += 1
        create_s = time.perf_counter() - started
        instance_id, rng = created.instance_id, random.Random(seed)
        load_s = (await resets_over_http(client, instance_id, range(seed, seed + 1)))[0]
        turns, done = 0, False
        while turns < POOL_EPISODE_TURNS and not done:
            actions = await client.available_actions(instance_id) or ["look around"]
            done = (await client.step(instance_id, rng.choice(actions))).done
            turns += 1
        await client.close(instance_id)
        return create_s, max(0.0, create_s - load_s), turns

    sampler = asyncio.create_task(sample())
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(episode(seed) for seed in range(instances)), return_exceptions=True)
    wall = time.perf_counter() - started
    finished.set()
    await sampler
    done = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    errors = [repr(outcome) for outcome in outcomes if isinstance(outcome, BaseException)]
    after = server.java_processes()
    return {
        "instances": instances,
        "pool_size": pool_size,
        "episode_turns": POOL_EPISODE_TURNS,
        "finished": len(done),
        "errors": errors[:5],
        "wall_s": wall,
        "steps": sum(turns for _, _, turns in done),
        "create_ms": latency([create_s for create_s, _, _ in done]),
        "create_max_ms": 1000 * max((create_s for create_s, _, _ in done), default=float("nan")),
        "wait_ms": latency([wait_s for _, wait_s, _ in done]),
        "wait_max_ms": 1000 * max((wait_s for _, wait_s, _ in done), default=float("nan")),
        "java_processes_max": max(map(len, seen), default=0),
        "java_pids_seen": len(set().union(*seen)),
        "java_processes_after": len(after),
        "refused_429": refused,
        "ok": len(done) == instances
        and max(map(len, seen), default=0) <= pool_size
        and len(after) == pool_size,
    }


async def run_embodied(args: argparse.Namespace) -> dict[str, Any]:
    """The two envs on a server whose pool has a JVM per client, then the pool run on a server of its own."""
    results: dict[str, Any] = {}
    pool_for_clients = {"STARGYM_SCIWORLD_POOL_SIZE": str(args.embodied_clients)}
    with EnvServerProcess(
        EMBODIED_ENVS[1], root=args.server_root.resolve(), environ=pool_for_clients
    ) as server:
        print(f"benchmarking the embodied envs on {server.url} ({args.seconds:g} s per configuration)")
        async with EnvClient(server.url, timeout=120.0) as client:
            for env_id in EMBODIED_ENVS:
                results[env_id] = await bench_embodied_env(
                    client, server, env_id, args.embodied_clients, args.seconds
                )
    pool = {"STARGYM_SCIWORLD_POOL_SIZE": str(args.pool_size)}
    with EnvServerProcess(EMBODIED_ENVS[1], root=args.server_root.resolve(), environ=pool) as server:
        print(f"  JVM pool: {args.pool_instances} SciWorld episodes on {args.pool_size} JVMs", flush=True)
        async with EnvClient(server.url, timeout=120.0) as client:
            results["jvm_pool"] = await bench_jvm_pool(client, server, args.pool_instances, args.pool_size)
    return results


def render_embodied(results: dict[str, Any]) -> None:
    from rich.table import Table

    console = wide_console()
    cores = results["machine"]["cpus"]
    table = Table(
        title=f"embodied envs: latency over HTTP against in-process, one client, {cores} cores",
        caption="reset: one instance, the same seeds in-process and over HTTP; step: random valid actions "
        "from available_actions (read after every step), finished episodes reset; SciWorld fresh JVM: a "
        "create on an empty pool slot (JVM start + reset); without hints: a fixed list of cheap actions",
    )
    for column in (
        "env",
        "call",
        "n (HTTP)",
        "in-process p50 ms",
        "p99 ms",
        "HTTP p50 ms",
        "p99 ms",
        "× in-process",
    ):
        table.add_column(column, justify="left" if column in ("env", "call") else "right")
    rows = [("reset", "reset"), ("reset_fresh_jvm", "reset, fresh JVM"), ("step", "step")]
    rows.append(("step_without_hints", "step, no action hints"))
    for env_id in EMBODIED_ENVS:
        for key, call in rows:
            if key not in results[env_id]:
                continue
            row = results[env_id][key]
            table.add_row(
                env_id,
                call,
                str(row["http"].get("n", row["http"].get("steps"))),
                f"{row['in_process']['p50_ms']:.2f}",
                f"{row['in_process']['p99_ms']:.2f}",
                f"{row['http']['p50_ms']:.2f}",
                f"{row['http']['p99_ms']:.2f}",
                f"{row['ratio_p50']:.2f}",
            )
    console.print(table)
    clients = Table(title="embodied envs: steps/s, one instance per client (server CPU includes its JVMs)")
    columns = ["env", "clients", "steps/s", "× in-process", "p50 ms", "p99 ms", "client CPU ms/step"]
    for column in [*columns, "server CPU ms/step", "other procs (cores)"]:
        clients.add_column(column, justify="left" if column == "env" else "right")
    for env_id in EMBODIED_ENVS:
        clients.add_row(env_id, "in-process", f"{results[env_id]['in_process_steps_per_s']:,.0f}", "1")
        for row in (results[env_id]["step"]["http"], results[env_id]["clients"]):
            clients.add_row(
                env_id,
                str(row["concurrency"]),
                f"{row['steps_per_s']:,.1f}",
                f"{row['ratio_to_in_process']:.3f}",
                f"{row['p50_ms']:.2f}",
                f"{row['p99_ms']:.2f}",
                f"{row['client_cpu_ms_per_step']:.3f}",
                f"{row['server_cpu_ms_per_step']:.3f}",
                f"{row['other_processes_cores']:.1f}",
            )
    console.print(clients)
    pool = results["jvm_pool"]
    mark = "[green]" if pool["ok"] else "[red]"
    console.print(
        f"{mark}JVM pool: {pool['finished']}/{pool['instances']} SciWorld episodes (≤ {pool['episode_turns']} "
        f"turns) finished on {pool['pool_size']} JVMs in {pool['wall_s']:.1f} s; create p50 "
        f"{pool['create_ms']['p50_ms'] / 1000:.2f} s, max {pool['create_max_ms'] / 1000:.2f} s; wait for a JVM "
        f"p50 {pool['wait_ms']['p50_ms'] / 1000:.2f} s, max {pool['wait_max_ms'] / 1000:.2f} s; java processes: "
        f"at most {pool['java_processes_max']} during ({pool['java_pids_seen']} seen), {pool['java_processes_after']} "
        f"after; {pool['refused_429']} × 429"
    )
    for error in pool["errors"]:
        console.print(f"[red]  {error}")


def bench_embodied(args: argparse.Namespace) -> int:
    """``--family embodied``: run, print, write ``--embodied-out``; 1 with ``--check`` if the pool misbehaved."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = run_loop(run_embodied(args), args.uvloop)
    results = {
        "machine": machine(load_before),
        "server_root": str(args.server_root.resolve()),
        "seconds_per_configuration": args.seconds,
        "seconds_in_all": round(time.perf_counter() - started, 1),
        "ratio_note": "latency: HTTP p50 over in-process p50; steps/s: HTTP over one in-process client",
        **results,
    }
    render_embodied(results)
    write(args.embodied_out, results)
    return 1 if args.check and not results["jvm_pool"]["ok"] else 0


# -- search ----------------------------------------------------------------------------------

SEARCH_ENV = "search/searchqa"
SEARCH_TOP_K = 3  # AgentGym's retrieval_topk, the env's default
# A wrong answer continues the episode (the env's default, AgentGym's server's): one reply in ten
# is one, the others search for the question's own text, so most steps pay for a retrieval.
SEARCHES_PER_WRONG_ANSWER = 9
WRONG_ANSWER = "<answer>not the answer</answer>"


def search_replies(observation: str) -> tuple[str, ...]:
    """A client's replies to the question ``observation`` shows: its text as a search, or a wrong answer."""
    question = observation.removeprefix("Question: ")
    return (f"<search>{question}</search>",) * SEARCHES_PER_WRONG_ANSWER + (WRONG_ANSWER,)


def folder_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 2**20


def load_search_data(cache_dir: Path) -> tuple[dict[str, float], Dataset, Retriever]:
    """The default dataset and its index, loaded as a server's ``prepare`` does; the seconds each took.

    The retriever is made directly, not through ``shared_retriever``, which would hand the cold
    run's index to the warm run.
    """
    from env_server.envs.search import facts
    from env_server.envs.search.retriever import Retriever

    started = time.perf_counter()
    dataset = facts.default_dataset(cache_dir)
    loaded = time.perf_counter()
    retriever = Retriever(dataset.passages, cache_dir)
    ended = time.perf_counter()
    seconds = {"dataset_s": loaded - started, "index_s": ended - loaded, "total_s": ended - started}
    return seconds, dataset, retriever


def bench_queries(retriever: Retriever, queries: list[str], seconds: float) -> dict[str, float]:
    """Top-``SEARCH_TOP_K`` searches for ``queries`` in turn, one per call as the env makes them."""
    latencies: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(64):
            before = time.perf_counter()
            retriever.search(queries[len(latencies) % len(queries)], SEARCH_TOP_K)
            latencies.append(time.perf_counter() - before)
    wall = time.perf_counter() - started
    return {"queries_per_s": len(latencies) / wall, "distinct_queries": len(queries)} | latency(latencies)


async def run_search(args: argparse.Namespace) -> dict[str, Any]:
    """Load times in-process and as server starts (cold, then warm), queries/s, then steps over HTTP."""
    from env_server.envs.search.searchqa import SearchData, SearchQAEnv

    policy = Policy(max_steps=SearchQAEnv.default_max_turns, from_observation=search_replies)
    results: dict[str, Any] = {"top_k": SEARCH_TOP_K, "max_turns": policy.max_steps}
    with tempfile.TemporaryDirectory(prefix="bench-search-") as folder:
        in_process_cache, server_cache = Path(folder) / "in-process", Path(folder) / "server"
        print("  search: dataset and index in-process, cold then warm", flush=True)
        cold, _, _ = load_search_data(in_process_cache)
        warm, dataset, retriever = load_search_data(in_process_cache)
        results["in_process_load"] = {"cold": cold, "warm": warm}
        results["corpus"] = {
            "passages": len(dataset.passages),
            "questions": {split: len(questions) for split, questions in dataset.questions.items()},
            "index_mib": folder_mib(in_process_cache / "search" / "index"),
            "dataset_cache_mib": folder_mib(in_process_cache)
            - folder_mib(in_process_cache / "search" / "index"),
        }
        single_hop = [q.question for split in dataset.questions.values() for q in split if q.hops == 1]
        results["queries"] = bench_queries(retriever, single_hop, args.seconds)
        env = SearchQAEnv(SearchData(dataset.questions, retriever))
        results["step_in_process"] = play_in_process(env, policy, args.seconds)
        environ = {"STARGYM_CACHE_DIR": str(server_cache)}
        root = args.server_root.resolve()
        with EnvServerProcess(SEARCH_ENV, root=root, environ=environ) as server:
            results["server_start"] = {"cold_s": server.start_s}
        with EnvServerProcess(SEARCH_ENV, root=root, environ=environ) as server:
            results["server_start"]["warm_s"] = server.start_s
            results["server_start"]["rss_mib"] = server.rss_bytes() / 2**20
            print(f"  search: steps on {server.url} ({args.seconds:g} s per configuration)", flush=True)
            async with EnvClient(server.url, timeout=60.0) as client:
                results["clients"] = await steps_by_clients(
                    client, server, args.search_concurrency, policy, args.seconds, results["step_in_process"]
                )
    return results


async def steps_by_clients(
    client: EnvClient,
    server: EnvServerProcess,
    concurrencies: list[int],
    policy: Policy,
    seconds: float,
    in_process: dict[str, float],
) -> list[dict[str, float]]:
    """:func:`bench_single` at each number of clients, each row with its ratio to ``in_process``'s rate."""
    rows = []
    for concurrency in concurrencies:
        episodes = await make_episodes(client, server.bench_env, concurrency, concurrency * 1000, policy)
        row = await bench_single(client, server, episodes, seconds)
        rows.append(row | {"ratio_to_in_process": row["steps_per_s"] / in_process["steps_per_s"]})
    return rows


STEP_COLUMNS = (
    "what", "clients", "per s", "× in-process", "p50 ms", "p99 ms",
    "client CPU ms/step", "server CPU ms/step", "other procs (cores)",
)  # fmt: skip


def add_step_rows(
    table: Any, what: str, in_process: dict[str, float], clients: list[dict[str, float]]
) -> None:
    """The in-process baseline row, then one row per number of clients over HTTP (:data:`STEP_COLUMNS`)."""
    table.add_row(
        what, "in-process", f"{in_process['steps_per_s']:,.0f}", "1",
        f"{in_process['p50_ms']:.2f}", f"{in_process['p99_ms']:.2f}",
    )  # fmt: skip
    for row in clients:
        table.add_row(
            "steps over HTTP", str(row["concurrency"]), f"{row['steps_per_s']:,.0f}",
            f"{row['ratio_to_in_process']:.3f}", f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}",
            f"{row['client_cpu_ms_per_step']:.3f}", f"{row['server_cpu_ms_per_step']:.3f}",
            f"{row['other_processes_cores']:.1f}",
        )  # fmt: skip


def render_search(results: dict[str, Any]) -> None:
    from rich.table import Table

    console = wide_console()
    corpus = results["corpus"]
    loads = Table(
        title=f"search/searchqa: data and index load, {corpus['passages']:,} passages",
        caption=f"cold: empty cache folder (facts generated, tantivy index built; index {corpus['index_mib']:.1f} "
        f"MiB, dataset cache {corpus['dataset_cache_mib']:.1f} MiB); warm: both cached. Server start: spawn to "
        "the first healthy answer (it loads them before it listens)",
    )
    for column in ("where", "cache", "dataset s", "index s", "total s"):
        loads.add_column(column, justify="left" if column in ("where", "cache") else "right")
    for cache in ("cold", "warm"):
        row = results["in_process_load"][cache]
        loads.add_row(
            "in-process", cache, f"{row['dataset_s']:.2f}", f"{row['index_s']:.2f}", f"{row['total_s']:.2f}"
        )
    for cache in ("cold", "warm"):
        loads.add_row("server start", cache, "", "", f"{results['server_start'][f'{cache}_s']:.2f}")
    console.print(loads)
    steps = Table(
        title=f"search/searchqa: retrieval and steps (top {results['top_k']}), {results['machine']['cpus']} cores",
        caption="queries: the single-hop questions' texts, one search per call; steps: 9 in 10 a search for "
        "the instance's question, 1 in 10 a wrong answer, reset after "
        f"{results['max_turns']} turns; one instance per client",
    )
    for column in STEP_COLUMNS:
        steps.add_column(column, justify="left" if column == "what" else "right")
    queries = results["queries"]
    steps.add_row(
        "retriever queries",
        "in-process",
        f"{queries['queries_per_s']:,.0f}",
        "",
        f"{queries['p50_ms']:.2f}",
        f"{queries['p99_ms']:.2f}",
    )
    add_step_rows(steps, "env steps", results["step_in_process"], results["clients"])
    console.print(steps)
    console.print(f"search server RSS after a warm start: {results['server_start']['rss_mib']:.0f} MiB")


def bench_search(args: argparse.Namespace) -> int:
    """``--family search``: run, print, write ``--search-out``."""
    note = "HTTP steps/s divided by one client's steps/s in this process (same replies, same index)"
    return run_family(args, SEARCH_ENV, run_search, render_search, args.search_out, note)


def run_family(
    args: argparse.Namespace,
    env_id: str,
    runner: Callable[[argparse.Namespace], Any],
    renderer: Callable[[dict[str, Any]], None],
    out: Path,
    ratio_note: str,
) -> int:
    """Run one family's measurements, add what every result file says (machine, timing), print, write."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = run_loop(runner(args), args.uvloop)
    results = {
        "env": env_id,
        "machine": machine(load_before),
        "server_root": str(args.server_root.resolve()),
        "seconds_per_configuration": args.seconds,
        "seconds_in_all": round(time.perf_counter() - started, 1),
        "ratio_note": ratio_note,
        **results,
    }
    renderer(results)
    write(out, results)
    return 0


# -- web -------------------------------------------------------------------------------------

WEB_ENV = "web/shop"
# What a random shopper searches for on the search page; every other step clicks a random clickable.
WEB_SEARCHES = tuple(
    f"search[{words}]"
    for words in (
        "wool socks",
        "vegan red lipstick",
        "ergonomic office chair",
        "organic green tea",
        "waterproof bluetooth speaker",
        "slim fit dress shirt",
        "queen bed frame easy assembly",
    )
)
WEB_POLICY = Policy(max_steps=15, refresh=True, open_text=WEB_SEARCHES)  # 15: the env's default turns
# One action kind at a time: a search from the search page, then a click on its first product, then
# "Back to Search" (also a click), so each latency is of one kind.
WEB_CYCLE = ("search", "product", "back")


def shop_cycle_action(kind: str, available: list[str] | None, rng: random.Random) -> str:
    if kind == "search":
        return rng.choice(WEB_SEARCHES)
    if kind == "product":
        assert available, "a results page lists its products"
        return available[2]  # after "back to search" and "next >": the first product
    return "click[back to search]"


def shop_latencies_in_process(env: Env, seconds: float) -> dict[str, dict[str, float]]:
    rng, latencies = random.Random(0), {"search": [], "click": []}
    env.reset(0, env.Options())
    started, turn = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        kind = WEB_CYCLE[turn % len(WEB_CYCLE)]
        action = shop_cycle_action(kind, env.available_actions(), rng)
        before = time.perf_counter()
        assert env.step(action).info["valid"], action
        latencies["search" if kind == "search" else "click"].append(time.perf_counter() - before)
        turn += 1
    return {kind: latency(values) for kind, values in latencies.items()}


async def shop_latencies_over_http(client: EnvClient, seconds: float) -> dict[str, dict[str, float]]:
    rng, latencies = random.Random(0), {"search": [], "click": []}
    instance = (await client.create(WEB_ENV, seed=0)).instance_id
    started, turn, available = time.perf_counter(), 0, None
    while time.perf_counter() - started < seconds:
        kind = WEB_CYCLE[turn % len(WEB_CYCLE)]
        action = shop_cycle_action(kind, available, rng)
        before = time.perf_counter()
        result = await client.step(instance, action)
        latencies["search" if kind == "search" else "click"].append(time.perf_counter() - before)
        assert result.info["valid"], action
        available = await client.available_actions(instance)
        turn += 1
    await client.close(instance)
    return {kind: latency(values) for kind, values in latencies.items()}


async def page_latencies(server_url: str, client: EnvClient, count: int) -> dict[str, float]:
    """GETs of the shop's HTML pages, as a person's browser makes them: the results page of a search."""
    import aiohttp

    instance = (await client.create(WEB_ENV, seed=0)).instance_id
    await client.step(instance, WEB_SEARCHES[0])
    seconds = []
    async with aiohttp.ClientSession() as http:
        for index in range(count):
            before = time.perf_counter()
            query = WEB_SEARCHES[index % len(WEB_SEARCHES)][7:-1]
            async with http.get(f"{server_url}/shop/{instance}/search", params={"q": query}) as response:
                assert response.status == 200
                await response.read()
            seconds.append(time.perf_counter() - before)
    await client.close(instance)
    return latency(seconds)


async def run_web(args: argparse.Namespace) -> dict[str, Any]:
    """Server starts (cold, warm), search and click latency in-process and over HTTP, steps/s."""
    from env_server.envs.search.retriever import Retriever
    from env_server.envs.web.catalog import generate_catalog, product_passages
    from env_server.envs.web.shop import ShopData, ShopEnv

    results: dict[str, Any] = {"max_turns": WEB_POLICY.max_steps}
    started = time.perf_counter()
    catalog = generate_catalog()
    generated = time.perf_counter()
    shop = ShopData(catalog, Retriever(product_passages(catalog.products.values())))
    results["in_process_load"] = {
        "catalog_s": generated - started,
        "index_in_memory_s": time.perf_counter() - generated,
        "products": len(catalog.products),
        "goals": {split: len(goals) for split, goals in catalog.goals.items()},
    }
    env = ShopEnv(shop)
    results["actions_in_process"] = shop_latencies_in_process(env, args.seconds)
    results["step_in_process"] = play_in_process(env, WEB_POLICY, args.seconds)
    with tempfile.TemporaryDirectory(prefix="bench-web-") as folder:
        environ = {"STARGYM_CACHE_DIR": folder}
        root = args.server_root.resolve()
        with EnvServerProcess(WEB_ENV, root=root, environ=environ) as server:
            results["server_start"] = {"cold_s": server.start_s}
        with EnvServerProcess(WEB_ENV, root=root, environ=environ) as server:
            results["server_start"] |= {"warm_s": server.start_s, "rss_mib": server.rss_bytes() / 2**20}
            print(
                f"  web: actions and steps on {server.url} ({args.seconds:g} s per configuration)", flush=True
            )
            async with EnvClient(server.url, timeout=60.0) as client:
                results["actions_over_http"] = await shop_latencies_over_http(client, args.seconds)
                results["pages_over_http"] = await page_latencies(server.url, client, 200)
                results["clients"] = await steps_by_clients(
                    client, server, args.web_concurrency, WEB_POLICY, args.seconds, results["step_in_process"]
                )
    return results


def render_web(results: dict[str, Any]) -> None:
    from rich.table import Table

    console = wide_console()
    load = results["in_process_load"]
    console.print(
        f"web/shop: {load['products']:,} products generated in {load['catalog_s']:.2f} s, indexed in memory "
        f"in {load['index_in_memory_s']:.2f} s; server start (spawn to healthy) "
        f"{results['server_start']['cold_s']:.2f} s cold, {results['server_start']['warm_s']:.2f} s with the "
        f"index cached, RSS {results['server_start']['rss_mib']:.0f} MiB"
    )
    table = Table(
        title=f"web/shop: action latency and steps/s, {results['machine']['cpus']} cores",
        caption="search: from the search page; click: a result's product, then Back to Search; page: a GET "
        "of a results page's HTML; steps: random clickables (a search where there is a search bar), "
        f"reset after {results['max_turns']} turns, one instance per client",
    )
    for column in STEP_COLUMNS:
        table.add_column(column, justify="left" if column == "what" else "right")
    for kind in ("search", "click"):
        here, there = results["actions_in_process"][kind], results["actions_over_http"][kind]
        table.add_row(kind, "in-process", "", "1", f"{here['p50_ms']:.2f}", f"{here['p99_ms']:.2f}")
        table.add_row(
            kind,
            "1",
            "",
            f"{there['p50_ms'] / here['p50_ms']:.2f}",
            f"{there['p50_ms']:.2f}",
            f"{there['p99_ms']:.2f}",
        )
    pages = results["pages_over_http"]
    table.add_row("page (HTML)", "1", "", "", f"{pages['p50_ms']:.2f}", f"{pages['p99_ms']:.2f}")
    add_step_rows(table, "steps", results["step_in_process"], results["clients"])
    console.print(table)


def bench_web(args: argparse.Namespace) -> int:
    """``--family web``: run, print, write ``--web-out``."""
    note = "HTTP latency or steps/s against the same env in this process (same catalog and index)"
    return run_family(args, WEB_ENV, run_web, render_web, args.web_out, note)


# -- reasoning, textarena ---------------------------------------------------------------------

# family: the env measured and how a client plays it.
ONE_ENV_FAMILIES: dict[str, tuple[str, Policy]] = {
    "reasoning": ("reasoning/basic_arithmetic", Policy(actions=("1", "-2", "7", "42"), max_steps=1)),
    "textarena": ("textarena/guess_the_number", Policy(max_steps=10)),
}


async def run_one_env_family(args: argparse.Namespace, family: str) -> dict[str, Any]:
    """The env's play in this process, then the server's start, RSS and steps by number of clients."""
    env_id, policy = ONE_ENV_FAMILIES[family]
    with in_process_env(env_id) as env:
        in_process = play_in_process(env, policy, args.seconds)
    results: dict[str, Any] = {"step_in_process": in_process}
    with EnvServerProcess(env_id, root=args.server_root.resolve()) as server:
        results["server_start"] = {"seconds": server.start_s, "rss_mib": server.rss_bytes() / 2**20}
        print(f"  {family}: steps on {server.url} ({args.seconds:g} s per configuration)", flush=True)
        async with EnvClient(server.url, timeout=60.0) as client:
            results["clients"] = await steps_by_clients(
                client, server, args.family_concurrency, policy, args.seconds, in_process
            )
    return results


def render_one_env_family(results: dict[str, Any]) -> None:
    from rich.table import Table

    console = wide_console()
    start = results["server_start"]
    steps = Table(
        title=f"{results['env']}: steps, {results['machine']['cpus']} cores shared by client and server",
        caption=f"one instance per client, episodes reset when done; server start (spawn to healthy) "
        f"{start['seconds']:.1f} s, RSS {start['rss_mib']:.0f} MiB",
    )
    for column in STEP_COLUMNS:
        steps.add_column(column, justify="left" if column == "what" else "right")
    add_step_rows(steps, "env steps", results["step_in_process"], results["clients"])
    console.print(steps)


def bench_one_env_family(args: argparse.Namespace, family: str) -> int:
    """``--family reasoning`` / ``textarena``: run, print, write ``bench/results/env_server_<family>.json``."""
    note = "HTTP steps/s divided by one client's steps/s in this process (same play)"
    out = args.results_dir / f"env_server_{family}.json"
    env_id = ONE_ENV_FAMILIES[family][0]
    return run_family(args, env_id, lambda a: run_one_env_family(a, family), render_one_env_family, out, note)


# -- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--family",
        choices=["game", "embodied", "search", "web", *ONE_ENV_FAMILIES, "all"],
        default="all",
        help="The env family to benchmark (game: --env; embodied: BabyAI and ScienceWorld; search: SearchQA; "
        "web: the shop; reasoning: basic_arithmetic; textarena: guess_the_number).",
    )
    parser.add_argument(
        "--env",
        choices=sorted(env for env in ENV_PATHS if env.startswith("game/")),
        help="Default: game/frozenlake (bandit if missing).",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="Measured time per configuration.")
    parser.add_argument("--concurrency", type=_ints, default=[1, 16, 64, 256])
    parser.add_argument("--batch-sizes", type=_ints, default=[16, 64, 256, 1024])
    parser.add_argument(
        "--openenv-concurrency", type=_ints, default=[1, 16], help="OpenEnv WebSocket sessions (game)."
    )
    parser.add_argument("--instances", type=int, default=10_000, help="Live instances for the memory check.")
    parser.add_argument("--uvloop", action="store_true", help="Run the client on uvloop.")
    parser.add_argument(
        "--check", action="store_true", help="Exit 1 if a target is missed or the JVM pool misbehaved."
    )
    parser.add_argument(
        "--server-root",
        type=Path,
        default=REPO_ROOT,
        help="Run the server from another checkout (a git worktree of an older commit) to compare.",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "env_server.json")
    parser.add_argument(
        "--embodied-clients", type=int, default=16, help="Concurrent clients per embodied env."
    )
    parser.add_argument(
        "--pool-instances", type=int, default=32, help="Concurrent SciWorld episodes on the pool."
    )
    parser.add_argument("--pool-size", type=int, default=4, help="JVMs in the pool they share.")
    parser.add_argument(
        "--embodied-out", type=Path, default=REPO_ROOT / "bench" / "results" / "env_server_embodied.json"
    )
    parser.add_argument(
        "--search-concurrency", type=_ints, default=[1, 16], help="Concurrent clients of the search env."
    )
    parser.add_argument(
        "--search-out", type=Path, default=REPO_ROOT / "bench" / "results" / "env_server_search.json"
    )
    parser.add_argument(
        "--web-concurrency", type=_ints, default=[1, 16], help="Concurrent clients of the web env."
    )
    parser.add_argument(
        "--web-out", type=Path, default=REPO_ROOT / "bench" / "results" / "env_server_web.json"
    )
    parser.add_argument(
        "--family-concurrency",
        type=_ints,
        default=[1, 16],
        help="Concurrent clients of the reasoning and textarena envs.",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=REPO_ROOT / "bench" / "results",
        help="Where the reasoning and textarena results go (env_server_<family>.json).",
    )
    return parser.parse_args()


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def run_loop(main: Any, uvloop: bool) -> Any:
    """Run a coroutine on asyncio's loop or (``--uvloop``) uvloop's."""
    if uvloop:
        import uvloop as uvloop_module

        return uvloop_module.run(main)
    return asyncio.run(main)


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def write(out: Path, results: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out}")


def bench_game(args: argparse.Namespace) -> int:
    """``--family game``: run, print, write ``--out``; 1 with ``--check`` if a target is missed."""
    import aiohttp

    load_before = os.getloadavg()
    max_instances = max(20000, args.instances + 2000)
    with EnvServerProcess(args.env, max_instances, args.server_root.resolve()) as server:
        env_class = load_env_class(server.bench_env)
        print(f"benchmarking {server.bench_env} on {server.url} ({args.seconds:g} s per configuration)")
        results = run_loop(run(args, server, env_class), args.uvloop)
    in_process = results["in_process"]["steps_per_s"]
    for row in results["single"] + results["batched"] + results["openenv"]:
        row["ratio_to_in_process"] = row["steps_per_s"] / in_process
    results = {
        "env": server.bench_env,
        "machine": machine(load_before),
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
    write(args.out, results)
    missed = [name for name, check in results["targets"].items() if check["met"] is False]
    return 1 if args.check and missed else 0


def main() -> int:
    args = parse_args()
    failed = bench_game(args) if args.family in ("game", "all") else 0
    if args.family in ("embodied", "all"):
        failed |= bench_embodied(args)
    if args.family in ("search", "all"):
        failed |= bench_search(args)
    if args.family in ("web", "all"):
        failed |= bench_web(args)
    for family in ONE_ENV_FAMILIES:
        if args.family in (family, "all"):
            failed |= bench_one_env_family(args, family)
    return failed


if __name__ == "__main__":
    sys.exit(main())
