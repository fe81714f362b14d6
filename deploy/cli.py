"""The ``stargym`` command."""

from __future__ import annotations

import typer

from deploy.dashboard import dashboard_command
from deploy.eval import eval_command
from deploy.model_init import model_init_command
from deploy.repro.command import repro_command
from deploy.train import train_command
from deploy.up import up_command
from env_server.serve import serve_command
from rollout_server.engine.serve import serve_command as engine_serve_command
from rollout_server.serve import rollout_command

app = typer.Typer(help="stargym: multi-turn RL for LLM agents.", no_args_is_help=True, add_completion=False)
env_app = typer.Typer(help="Environment servers.", no_args_is_help=True)
app.add_typer(env_app, name="env")
env_app.command("serve")(serve_command)
model_app = typer.Typer(help="Policy models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
model_app.command("init")(model_init_command)
engine_app = typer.Typer(help="Inference engines.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")
engine_app.command("serve")(engine_serve_command)
app.command("rollout")(rollout_command)
app.command("eval")(eval_command)
app.command("train")(train_command)
app.command("up")(up_command)
app.command("dashboard")(dashboard_command)
app.command("repro")(repro_command)


@env_app.command("list")
def list_envs() -> None:
    """List the envs registered under the 'stargym.envs' entry-point group."""
    from env_server.registry import registered_ids

    for env_id in registered_ids():
        typer.echo(env_id)
