"""A container's ``stargym`` command and environment, as the code that runs them reads them.

docker-compose.yml and the Kubernetes manifests start the one stargym image with a role command (the
arguments after its ``stargym`` entrypoint) and ``STARGYM_*`` variables. A misspelt option fails only
when a container starts, and a misspelt variable never does (pydantic-settings ignores names it does
not know), so the tests of both read them here with the CLI's own parser and the services' own
settings classes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from deploy import cli
from deploy.train import load_train_config
from rollout_server.engine.settings import EngineSettings
from rollout_server.settings import WorkerSettings
from services.contracts import ENGINE_PORT, FAMILY_PORTS, ROLLOUT_PORT, TRAINER_PORT
from services.settings import EnvServerSettings
from trainer.config import TrainConfig
from trainer.service import TrainerSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
IMAGE_CONFIGS = Path("/opt/stargym/configs")  # where the image (and compose's bind mount) put configs/

# What each stargym command serves on, from the code (services.contracts) ...
SUBCOMMAND_PORTS = {
    ("engine", "serve"): ENGINE_PORT,
    ("rollout",): ROLLOUT_PORT,
    ("train",): TRAINER_PORT,
}
# ... and the settings class that reads its environment.
SUBCOMMAND_SETTINGS: dict[tuple[str, ...], type[BaseSettings]] = {
    ("env", "serve"): EnvServerSettings,
    ("engine", "serve"): EngineSettings,
    ("rollout",): WorkerSettings,
    ("train",): TrainerSettings,
}


def parse_stargym(args: list[str]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The subcommand path and the parsed parameters of ``stargym ARGS``, as the CLI parses them.

    Raises the CLI's usage errors for an unknown subcommand or option, a missing argument or a bad value.
    """
    command = typer.main.get_command(cli.app)
    path: list[str] = []
    rest = list(args)
    while hasattr(command, "commands"):  # a group (typer vendors its own click)
        assert rest, f"stargym {' '.join(path)} needs a subcommand"
        name, rest = rest[0], rest[1:]
        assert name in command.commands, f"stargym has no subcommand {' '.join([*path, name])!r}"
        command = command.commands[name]
        path.append(name)
    context = command.make_context(" ".join(["stargym", *path]), rest, resilient_parsing=False)
    return tuple(path), context.params


def served_port(path: tuple[str, ...], params: dict[str, Any]) -> int:
    """The port the code says this subcommand serves on."""
    if path == ("env", "serve"):
        (family,) = params["families"]
        return FAMILY_PORTS[family]
    return SUBCOMMAND_PORTS[path]


def train_config(params: dict[str, Any]) -> TrainConfig:
    """The config ``stargym train`` loads: one of the repo's (the image has configs/ at
    /opt/stargym/configs), with the command's ``--set`` overrides."""
    path = Path(params["config_path"])
    assert path.parent == IMAGE_CONFIGS, f"{path} is not one of the image's configs"
    return load_train_config(REPO_ROOT / "configs" / path.name, params["set_"])


# -- settings ---------------------------------------------------------------------------------------


def is_setting(var: str) -> bool:
    """A variable meant for a stargym settings class (the others are for Python, torch, CUDA...)."""
    return var.startswith("STARGYM_") or var == "REDIS_URL"


def env_names(settings: type[BaseSettings]) -> dict[str, str]:
    """Upper-cased environment variable → the field it sets, as pydantic-settings reads them."""
    prefix = settings.model_config.get("env_prefix", "")
    found: dict[str, str] = {}
    for field, info in settings.model_fields.items():
        alias = info.validation_alias
        if alias is None:
            candidates = [prefix + field]
        elif isinstance(alias, AliasChoices):
            candidates = [choice for choice in alias.choices if isinstance(choice, str)]
        else:
            candidates = [str(alias)]
        for name in candidates:
            found[name.upper()] = field
    return found


def load_settings(
    settings_class: type[BaseSettings],
    environment: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    where: str = "",
) -> BaseSettings:
    """``settings_class`` as a service whose settings variables are exactly ``environment``'s reads it.

    Fails for a settings variable (:func:`is_setting`) that is not one of the class's, and for one
    that does not decide its field: each must give the value it gives alone, so a shared name that a
    ``STARGYM_ROLLOUT_*`` one beside it overrides fails too. The caller's own ``STARGYM_*`` and
    ``REDIS_URL`` are unset meanwhile (``monkeypatch`` restores them). ``where`` starts the failure
    messages: the container or service that would read the variables.
    """
    fields = env_names(settings_class)
    ours = {var: value for var, value in environment.items() if is_setting(var)}
    for var in ours:
        assert var.upper() in fields, f"{where}: {var} is not a setting of {settings_class.__name__}"
    for var in list(os.environ):
        if is_setting(var):
            monkeypatch.delenv(var)
    for var, value in ours.items():
        monkeypatch.setenv(var, value)
    settings = settings_class()
    for var, value in ours.items():
        field = fields[var.upper()]
        # model_validate reads no environment: the value of this variable alone, validated the same way.
        key = field if settings_class.model_fields[field].validation_alias is None else var
        alone = getattr(settings_class.model_validate({key: value}), field)
        got = getattr(settings, field)
        assert got == alone, (
            f"{where}: {var}={value!r} set {field} to {alone!r}, but the service reads {got!r}"
        )
    return settings
