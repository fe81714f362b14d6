"""``stargym dashboard RUNS_DIR``: the dashboard of finished (and running) runs, without a trainer.

    stargym dashboard checkpoints/
    stargym dashboard runs/ --port 8301 --redis-url redis://127.0.0.1:6379/0 [--run NAME]

Serves the same pages as the trainer's own dashboard, read-only, over every run directory under
``RUNS_DIR``. With ``--redis-url`` (or ``REDIS_URL``) the system view shows the services of one
run against that Redis (its rollout workers announce themselves there, with their env servers and
engines): ``--run``, by default the run under ``RUNS_DIR`` written last (by its ``run.name``), the live
one while a run trains; without a Redis URL it says it has nothing to show. ``STARGYM_API_TOKEN`` protects it as it
protects every service.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from fastapi import FastAPI
from pydantic import Field

from services.http_app import create_app
from services.rollout_protocol import RUN_ID_PATTERN
from services.settings import ServiceSettings
from trainer.config import RunConfig


class DashboardSettings(ServiceSettings):
    """Where the dashboard listens and which Redis it watches (``STARGYM_*``, ``REDIS_URL``)."""

    port: int = 8300
    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL")


def dashboard_command(
    runs_dir: Annotated[
        Path, typer.Argument(metavar="RUNS_DIR", help="Directory holding run directories (checkpoints/).")
    ],
    port: Annotated[int | None, typer.Option(help="HTTP port; default 8300 (STARGYM_PORT).")] = None,
    host: Annotated[
        str | None, typer.Option(help="Listen address; default 127.0.0.1 (STARGYM_HOST).")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis of running services, for the system view (REDIS_URL).")
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(help="Run whose services the system view shows; default: the newest under RUNS_DIR."),
    ] = None,
) -> None:
    """Serve the dashboard of the runs under RUNS_DIR."""
    from services.serving import run_service
    from trainer.dashboard.app import install_dashboard
    from trainer.dashboard.runs import RunsDirectory
    from trainer.dashboard.system import SystemProbe
    from trainer.dashboard.tokens import TokenTexts

    if not runs_dir.is_dir():
        raise typer.BadParameter(f"{runs_dir} is not a directory", param_hint="RUNS_DIR")
    overrides = {key: value for key, value in {"port": port, "host": host}.items() if value is not None}
    settings = DashboardSettings(**overrides)
    redis_url = redis_url or settings.redis_url
    token = settings.api_token.get_secret_value() if settings.api_token is not None else None
    probe = None
    if redis_url:
        run_id = run or newest_run(runs_dir)
        probe = SystemProbe(redis_url=redis_url, env_servers={}, api_token=token, run_id=run_id)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if probe is not None:
            await probe.aclose()

    app = create_app(
        "dashboard", settings, description="stargym dashboard: runs, charts, trajectories.", lifespan=lifespan
    )
    system = None
    if probe is not None:

        async def system() -> dict[str, Any]:
            return (await probe.snapshot()).model_dump(mode="json")

    install_dashboard(app, RunsDirectory(runs_dir), texts=TokenTexts(), system=system)
    shown = f"; system view: run {probe.keys.run_id!r}" if probe is not None else ""
    typer.echo(f"dashboard of {runs_dir.resolve()} at http://{settings.host}:{settings.port}/{shown}")
    run_service(app, settings)


def newest_run(runs_dir: Path) -> str:
    """The run id of the run under ``runs_dir`` written last (a training run appends to its
    metrics every step), or the trainer's default run name when there is none.

    The id is the ``run.name`` of that run's saved config, not its directory's name: a run's
    ``run.output_dir`` may be any directory, and Redis knows the run by its name only."""
    from trainer.dashboard.runs import CONFIG_FILE, RunReader, RunsDirectory
    from trainer.metrics import METRICS_FILE

    def written(path: Path) -> float:
        files = [path / CONFIG_FILE, path / METRICS_FILE]
        return max(file.stat().st_mtime for file in files if file.is_file())

    runs = [runs_dir / name for name in RunsDirectory(runs_dir).names()]
    if not runs:
        return RunConfig().name
    newest = max(runs, key=written)
    name = RunReader(newest).config().get("run", {}).get("name")
    return name if isinstance(name, str) and re.fullmatch(RUN_ID_PATTERN, name) else newest.name
