"""``stargym rollout``: the rollout worker, jobs from Redis played against engines and env servers.

    stargym rollout --engine-url http://127.0.0.1:8210 --env game=http://127.0.0.1:8101 \\
        --concurrency 64 --port 8200
    stargym rollout --engine-model models/tiny --env game=http://127.0.0.1:8101   # the engine in-process

Redis comes from ``REDIS_URL``; every flag also reads a ``STARGYM_ROLLOUT_*`` variable (see
:mod:`rollout_server.settings`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rollout_server.settings import WorkerSettings, parse_engine_urls
from services.contracts import parse_env_servers
from services.serving import run_service, settings_from_flags

if TYPE_CHECKING:
    from rollout_server.engine.app import EngineState


def rollout_command(
    engine_url: Annotated[
        list[str] | None,
        typer.Option(
            "--engine-url",
            help="Inference server(s), comma-separated or repeated; a name that resolves to several "
            "addresses is one server per address [STARGYM_ROLLOUT_ENGINE_URLS].",
        ),
    ] = None,
    engine_model: Annotated[
        str | None,
        typer.Option(
            help="Run the CPU engine on this model directory in the worker's process, instead of "
            "using --engine-url: no HTTP between episodes and engine; its protocol is served under "
            "/engine on the worker's port [STARGYM_ROLLOUT_ENGINE_MODEL].",
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            help="FAMILY=URL[,URL...]: the env servers of a family, repeated per family; a name that "
            "resolves to several addresses is one server per address [STARGYM_ROLLOUT_ENV_URLS].",
        ),
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(help="The run served: the trainer's run.name, default 'run' [STARGYM_ROLLOUT_RUN]."),
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Episodes at once [STARGYM_ROLLOUT_CONCURRENCY].")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer and chat template directory of the policy; default: --engine-model's, or "
            "the model directory the engine reports [STARGYM_ROLLOUT_TOKENIZER]."
        ),
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
        "engine_model": engine_model,
        "env_urls": _env_urls(env) if env else None,
        "run": run,
        "concurrency": concurrency,
        "tokenizer": tokenizer,
        "host": host,
        "port": port,
        "consumer": consumer,
        "visibility_timeout_s": visibility_timeout_s,
        "shutdown_grace_s": shutdown_grace_s,
    }
    if engine_url and engine_model:
        raise typer.BadParameter(
            "--engine-model runs the engine in this worker, --engine-url uses engines elsewhere: give one",
            param_hint="--engine-model",
        )
    settings = settings_from_flags(WorkerSettings, overrides)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = _engine_in_process(settings) if settings.engine_model is not None else None
    tokenizer_dir = settings.tokenizer or settings.engine_model or asyncio.run(_engine_model_dir(settings))
    if not Path(tokenizer_dir).is_dir():
        raise typer.BadParameter(f"{tokenizer_dir!r} is not a directory", param_hint="--tokenizer")
    # transformers loads here: every `stargym` command imports this module.
    from transformers import AutoTokenizer

    from rollout_server.app import build_app
    from rollout_server.episode import chat_format

    try:
        if engine is not None and settings.tokenizer is None:
            loaded = engine.tokenizer  # the engine in this process loaded its model's already
        else:
            loaded = AutoTokenizer.from_pretrained(tokenizer_dir)
        chat_format(loaded)  # a chat template that cannot be extended turn by turn fails here, once
    except (OSError, ValueError) as exc:  # ChatTemplateError is a ValueError
        raise typer.BadParameter(f"cannot use the tokenizer in {tokenizer_dir!r}: {exc}") from None
    run_service(build_app(settings, loaded, engine=engine), settings)


def _engine_in_process(settings: WorkerSettings) -> EngineState:
    """The engine of ``--engine-model``, loaded here: ``stargym engine serve``'s settings from
    ``STARGYM_*``, with room for a sequence per episode, and no token of its own: its routes are
    the worker's, behind the worker's token."""
    from rollout_server.engine.serve import load_engine
    from rollout_server.engine.settings import EngineSettings

    engine_settings = settings_from_flags(EngineSettings, {"model": settings.engine_model})
    update = {"api_token": None, "max_num_seqs": max(engine_settings.max_num_seqs, settings.concurrency)}
    return load_engine(engine_settings.model_copy(update=update), model_flag="--engine-model")


def _env_urls(values: list[str]) -> dict[str, list[str]]:
    try:
        return parse_env_servers(values)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--env") from None


async def _engine_model_dir(settings: WorkerSettings) -> str:
    """The local model directory the engines report (ours and vLLM's ``/v1/models`` ``root``)."""
    from services.engine_client import EngineClient, EngineClientError

    token = settings.engine_api_token.get_secret_value() if settings.engine_api_token else None
    try:
        async with EngineClient(settings.engine_urls, token=token, timeout=30.0) as engine:
            found = await engine.served_model_dir()
    except EngineClientError as exc:
        raise typer.BadParameter(
            f"pass --tokenizer DIR: the engine could not be asked for its model directory: {exc}",
            param_hint="--tokenizer",
        ) from None
    if found is None:
        raise typer.BadParameter(
            f"pass --tokenizer DIR: the engine at {', '.join(settings.engine_urls)} does not report a "
            "local model directory with a tokenizer in it",
            param_hint="--tokenizer",
        )
    return str(found)
