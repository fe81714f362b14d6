"""``stargym train CONFIG``: the trainer service of one run, resumed from its newest checkpoint.

    stargym train configs/frozenlake-tiny.yaml
    stargym train configs/frozenlake-tiny.yaml --set optim.total_steps=50 --set run.output_dir=runs/x

    stargym train configs/frozenlake-tiny.yaml --nproc-per-node 2
    torchrun --nproc-per-node 2 -m deploy train configs/frozenlake-tiny.yaml

Redis comes from ``REDIS_URL``; the HTTP API (``/health``, ``/metrics``, ``/status``) listens on the
config's ``dashboard.port`` (8300) unless ``--port`` says otherwise. Rollout workers, env servers
and an engine must be running (``stargym up CONFIG`` starts them all). With
``model.init_tiny_if_missing`` an absent model directory is made first, as ``stargym model init``.

``--nproc-per-node N`` runs the trainer as N processes under torchrun
(``python -m torch.distributed.run``, which replaces this process): rank 0 is the trainer service
(controller, Redis, HTTP API, checkpoints), every rank updates on its share of each batch
(:mod:`trainer.ranks`). Started by a user's own ``torchrun``, the same command reads ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` and does the same. torchrun ends the job when a rank dies; a
restart resumes every rank from the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml

from trainer.config import ConfigError, TrainConfig, load_config

if TYPE_CHECKING:
    import torch

    from trainer.ranks import RankInfo


def parse_overrides(values: list[str] | None) -> dict[str, Any]:
    """``['optim.lr=1e-3', 'run.name=x']`` → ``{'optim.lr': 0.001, 'run.name': 'x'}`` (YAML values)."""
    overrides: dict[str, Any] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} must be KEY=VALUE, e.g. optim.lr=1e-3", param_hint="--set")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def load_train_config(path: Path, overrides: list[str] | None = None) -> TrainConfig:
    try:
        return load_config(path, parse_overrides(overrides))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="CONFIG") from None


def ensure_model(config: TrainConfig) -> None:
    """Make the tiny policy at ``model.path`` if it is absent and the config asks for it."""
    path = Path(config.model.path)
    if (path / "config.json").is_file():
        return
    if not config.model.init_tiny_if_missing:
        raise typer.BadParameter(
            f"model.path {str(path)!r} has no model: run `stargym model init --out {path}` "
            "or set model.init_tiny_if_missing: true"
        )
    from deploy.model_init import DEFAULT_FAMILY, init_tiny_model

    # The vocabulary is built from the envs the run trains on: the smaller it is, the more often a
    # random policy names a valid action (single tokens), which is where learning starts.
    envs = [env.id for env in config.envs.mix] or [DEFAULT_FAMILY]
    options = {env.id: env.options for env in config.envs.mix if env.options is not None}
    typer.echo(f"model {path} is missing: making the tiny policy from {', '.join(envs)}")
    init_tiny_model(path, config.run.seed, envs, 100, 20, options)


def train_command(
    config_path: Annotated[Path, typer.Argument(metavar="CONFIG", help="Run config (configs/*.yaml).")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a config key, KEY=VALUE (YAML value); repeatable."),
    ] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port; default: the config's dashboard.port.")] = None,
    host: Annotated[
        str | None, typer.Option(help="Listen address; default: the config's dashboard.host.")
    ] = None,
    max_minutes: Annotated[
        float | None, typer.Option(min=0.0, help="Stop (with a checkpoint) after this many minutes.")
    ] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="torch intra-op threads.")] = None,
    device: Annotated[
        str | None, typer.Option(help="torch device; default cuda if available, else cpu.")
    ] = None,
    nproc_per_node: Annotated[
        int, typer.Option(min=1, help="Trainer processes (torchrun); each updates on a share of every batch.")
    ] = 1,
    keep_serving: Annotated[
        bool,
        typer.Option(
            help="When the run is done, keep serving the dashboard and /status until stopped (containers)."
        ),
    ] = False,
) -> None:
    """Train a policy: issue rollout jobs, update on trajectories, publish policies, checkpoint."""
    config = load_train_config(config_path, set_)
    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc_per_node}",
        ]
        args += ["-m", "deploy", *_forwarded_args(sys.argv[1:])]
        os.execv(sys.executable, args)
    from trainer.ranks import init_distributed, leave_distributed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    ranks, chosen = init_distributed(device)
    try:
        code = _run_rank(config, ranks, chosen, host, port, max_minutes, keep_serving)
    finally:
        leave_distributed()
    if code:
        raise typer.Exit(code)


def _run_rank(
    config: TrainConfig,
    ranks: RankInfo,
    chosen: torch.device,
    host: str | None,
    port: int | None,
    max_minutes: float | None,
    keep_serving: bool,
) -> int:
    """This process's part of the run: rank 0 serves the trainer, the others follow it."""
    from trainer.service import Trainer, TrainerSettings, follow_leader, serve

    if ranks.leader:
        ensure_model(config)
    if ranks.distributed:
        import torch.distributed as dist

        dist.barrier()  # the model exists before any rank loads it
    if not ranks.leader:
        # torchrun signals every rank at once; a follower ends when rank 0, which saves a final
        # checkpoint with its help, says so (or when torchrun kills it).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow_leader(config, chosen)
        return 0

    settings = TrainerSettings(
        **{
            key: value
            for key, value in {
                "host": host or os.environ.get("STARGYM_HOST") or config.dashboard.host,
                "port": port or config.dashboard.port,
            }.items()
        }
    )
    trainer = Trainer(
        config, redis_url=settings.redis_url, max_minutes=max_minutes, device=str(chosen), ranks=ranks
    )
    return serve(trainer, settings, keep_serving=keep_serving)


def _forwarded_args(argv: list[str]) -> list[str]:
    """This command's arguments for each torchrun process: the same, less ``--nproc-per-node``."""
    forwarded: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            forwarded.append(arg)
    return forwarded
