"""Running an env server. ``serve_command`` is both ``stargym env serve`` and ``python -m env_server``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from env_server.app import build_app
from env_server.core import EnvFailure
from env_server.registry import EnvLoadError, load_envs
from services.contracts import FAMILY_PORTS
from services.serving import run_service
from services.settings import EnvServerSettings


def serve_command(
    families: Annotated[list[str] | None, typer.Argument(help="Env families to host, e.g. 'game'.")] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", help="An env class, 'package.module:Class' or 'file.py:Class'."),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address [STARGYM_HOST].")] = None,
    port: Annotated[
        int | None,
        typer.Option(help="Port; default: the family's (game 8101 … textarena 8106) [STARGYM_PORT]."),
    ] = None,
    max_instances: Annotated[int | None, typer.Option(help="Instance limit [STARGYM_MAX_INSTANCES].")] = None,
    instance_ttl_s: Annotated[float | None, typer.Option(help="Idle TTL [STARGYM_INSTANCE_TTL_S].")] = None,
    corpus: Annotated[
        Path | None,
        typer.Option(help="search: your passages, JSONL of {id, title, text} [STARGYM_SEARCH_CORPUS]."),
    ] = None,
    questions: Annotated[
        Path | None,
        typer.Option(help="search: your questions, JSONL of {question, answers} [STARGYM_SEARCH_QUESTIONS]."),
    ] = None,
    catalog: Annotated[
        Path | None,
        typer.Option(help="web: WebShop's product file, items_shuffle.json [STARGYM_WEB_CATALOG]."),
    ] = None,
    attributes: Annotated[
        Path | None,
        typer.Option(help="web: WebShop's attribute file, items_ins_v2.json [STARGYM_WEB_ATTRIBUTES]."),
    ] = None,
) -> None:
    """Serve env families (and single env classes) over HTTP."""
    families = families or []
    # The search and web families read their data settings from the environment (SearchSettings,
    # WebSettings), where `prepare` below and every worker thread find them.
    for variable, path in (
        ("STARGYM_SEARCH_CORPUS", corpus),
        ("STARGYM_SEARCH_QUESTIONS", questions),
        ("STARGYM_WEB_CATALOG", catalog),
        ("STARGYM_WEB_ATTRIBUTES", attributes),
    ):
        if path is not None:
            os.environ[variable] = str(path)
    overrides = {
        "host": host,
        "port": port,
        "max_instances": max_instances,
        "instance_ttl_s": instance_ttl_s,
    }
    settings = EnvServerSettings(**{k: v for k, v in overrides.items() if v is not None})
    if port is None and "port" not in settings.model_fields_set and len(families) == 1:
        settings.port = FAMILY_PORTS.get(families[0], settings.port)
    try:
        env_classes = load_envs(families, env or [])
    except EnvLoadError as exc:
        raise typer.BadParameter(str(exc)) from None
    for env_id, env_class in env_classes.items():
        try:
            env_class.prepare()
        except EnvFailure as exc:
            typer.echo(f"cannot serve {env_id}: {exc}", err=True)
            raise typer.Exit(2) from None
    try:
        app = build_app(env_classes, settings)
    except TypeError as exc:  # an env wired against what the host can do (env_server/sandbox.py)
        typer.echo(f"cannot serve: {exc}", err=True)
        raise typer.Exit(2) from None
    # An OpenEnv websocket message is bounded like a request body.
    run_service(app, settings, ws_max_size=settings.max_body_bytes)


def main() -> None:
    typer.run(serve_command)
