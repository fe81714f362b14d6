"""The ``stargym`` command."""

from __future__ import annotations

import typer

from env_server.serve import serve_command

app = typer.Typer(help="stargym: multi-turn RL for LLM agents.", no_args_is_help=True, add_completion=False)
env_app = typer.Typer(help="Environment servers.", no_args_is_help=True)
app.add_typer(env_app, name="env")
env_app.command("serve")(serve_command)


@env_app.command("list")
def list_envs() -> None:
    """List the envs registered under the 'stargym.envs' entry-point group."""
    from env_server.registry import registered_ids

    for env_id in registered_ids():
        typer.echo(env_id)
