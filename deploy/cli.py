"""The ``stargym`` command.

The commands that read a run config (``train``, ``up``, ``dashboard``, ``repro``) are imported only
when one of them is run or ``--help`` lists them: the config validates ``algorithm.advantage``
against the estimator registry, which imports torch. Every service the launcher starts is a
``stargym`` process, and the env servers and the rollout worker need no torch: importing it first
took 6 s of a loaded 2-core machine's start (``python -X importtime -m deploy env --help``; 1.1 s
without it).
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from deploy.eval import eval_command
from deploy.model_init import model_init_command
from env_server.serve import serve_command
from rollout_server.engine.serve import serve_command as engine_serve_command
from rollout_server.serve import rollout_command

LAZY_COMMANDS = {
    "train": "deploy.train:train_command",
    "up": "deploy.up:up_command",
    "dashboard": "deploy.dashboard:dashboard_command",
    "repro": "deploy.repro.command:repro_command",
}
"""Command name to ``module:function``, imported when the command is first looked up."""


class LazyGroup(TyperGroup):
    """The top-level group: :data:`LAZY_COMMANDS` join it when they are first looked up."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in LAZY_COMMANDS if name not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module, function = LAZY_COMMANDS[cmd_name].split(":")
            single = typer.Typer(add_completion=False)
            single.command(cmd_name)(getattr(importlib.import_module(module), function))
            self.add_command(typer.main.get_command(single), cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and args[0] not in LAZY_COMMANDS:
            for name in LAZY_COMMANDS:  # a misspelt command: suggest among all of them
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=LazyGroup, help="stargym: multi-turn RL for LLM agents.", no_args_is_help=True, add_completion=False
)
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


@env_app.command("list")
def list_envs() -> None:
    """List the envs registered under the 'stargym.envs' entry-point group."""
    from env_server.registry import registered_ids

    for env_id in registered_ids():
        typer.echo(env_id)
