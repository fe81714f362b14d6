"""``stargym rollout``: the rollout worker, jobs from Redis played against engines and env servers.

    stargym rollout --engine-url http://127.0.0.1:8210 --env game=http://127.0.0.1:8101 \\
        --concurrency 64 --port 8200

Redis comes from ``REDIS_URL``; every flag also reads a ``STARGYM_ROLLOUT_*`` variable (see
:mod:`rollout_server.settings`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from rollout_server.settings import WorkerSettings, parse_engine_urls, parse_env_urls


def rollout_command(
    engine_url: Annotated[
        list[str] | None,
        typer.Option(
            "--engine-url",
            help="Inference server(s), comma-separated or repeated [STARGYM_ROLLOUT_ENGINE_URLS].",
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env", help="FAMILY=URL of an env server, repeated per family [STARGYM_ROLLOUT_ENV_URLS]."
        ),
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Episodes at once [STARGYM_ROLLOUT_CONCURRENCY].")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Tokenizer and chat template directory of the policy [STARGYM_ROLLOUT_TOKENIZER]."),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Listen address [STARGYM_ROLLOUT_HOST, STARGYM_HOST].")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Port, default 8200 [STARGYM_ROLLOUT_PORT, STARGYM_PORT].")
    ] = None,
    consumer: Annotated[
        str | None, typer.Option(help="Consumer name in the 'rollout' group [STARGYM_ROLLOUT_CONSUMER].")
    ] = None,
    visibility_timeout_s: Annotated[
        float | None,
        typer.Option(help="Pending this long, a job is reclaimed [STARGYM_ROLLOUT_VISIBILITY_TIMEOUT_S]."),
    ] = None,
    shutdown_grace_s: Annotated[
        float | None,
        typer.Option(help="On SIGTERM, time for in-flight episodes [STARGYM_ROLLOUT_SHUTDOWN_GRACE_S]."),
    ] = None,
) -> None:
    """Consume rollout jobs, play the episodes, publish the trajectories."""
    overrides = {
        "engine_urls": parse_engine_urls(",".join(engine_url)) if engine_url else None,
        "env_urls": _env_urls(env) if env else None,
        "concurrency": concurrency,
        "tokenizer": tokenizer,
        "host": host,
        "port": port,
        "consumer": consumer,
        "visibility_timeout_s": visibility_timeout_s,
        "shutdown_grace_s": shutdown_grace_s,
    }
    try:
        settings = WorkerSettings(**{key: value for key, value in overrides.items() if value is not None})
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not Path(settings.tokenizer).is_dir():
        raise typer.BadParameter(f"{settings.tokenizer!r} is not a directory", param_hint="--tokenizer")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # transformers and uvicorn load here: every `stargym` command imports this module.
    import uvicorn
    from transformers import AutoTokenizer

    from rollout_server.app import build_app
    from rollout_server.episode import chat_format

    try:
        loaded = AutoTokenizer.from_pretrained(settings.tokenizer)
        chat_format(loaded)  # a chat template that cannot be extended turn by turn fails here, once
    except (OSError, ValueError) as exc:  # ChatTemplateError is a ValueError
        raise typer.BadParameter(f"cannot use the tokenizer in {settings.tokenizer!r}: {exc}") from None
    uvicorn.run(
        build_app(settings, loaded),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


def _env_urls(values: list[str]) -> dict[str, str]:
    try:
        return parse_env_urls(",".join(values))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--env") from None
