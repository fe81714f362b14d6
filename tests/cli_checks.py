"""A container's ``stargym`` command and environment, as the code that runs them reads them.

docker-compose.yml and the Kubernetes manifests start the one stargym image with a role command (the
arguments after its ``stargym`` entrypoint) and ``STARGYM_*`` variables. A misspelt option fails only
when a container starts, and a misspelt variable never does (pydantic-settings ignores names it does
not know), so the tests of both read them here with the CLI's own parser and the services' own
settings classes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from deploy import cli
from deploy.train import load_train_config
from env_server.envs.embodied.jvm_pool import JvmPoolSettings
from env_server.envs.search.facts import cache_root
from env_server.envs.search.searchqa import SearchSettings
from env_server.envs.web.shop import WebSettings
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


# Settings an env family's own code reads from its env server's environment, besides the host's.
FAMILY_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "embodied": (JvmPoolSettings,),
    "search": (SearchSettings,),
    "web": (WebSettings,),
}
# Variables an env family's code reads from os.environ itself, not through a settings class, and
# the function that reads each: given the variable, it must return the value.
FAMILY_VARIABLES: dict[str, dict[str, Callable[[], object]]] = {
    "search": {"STARGYM_CACHE_DIR": cache_root},
    "web": {"STARGYM_CACHE_DIR": cache_root},  # the shop's search index, cached as the search family's
}

# What the embodied env server's memory limit must hold, measured: the Python server was 310 MiB
# resident after five ScienceWorld gold paths; a JVM with all of its heap committed
# (-XX:+AlwaysPreTouch) was 96 MiB above its heap.
EMBODIED_SERVER_MIB = 512
JVM_NON_HEAP_MIB = 128


def embodied_memory_mib(pool: JvmPoolSettings) -> int:
    """The most memory the embodied env server uses with ``pool``: the server and every JVM full."""
    return EMBODIED_SERVER_MIB + pool.pool_size * (pool.heap_mb + JVM_NON_HEAP_MIB)


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
        subcommand = command.get_command(None, name)  # the top level imports some commands when asked
        assert subcommand is not None, f"stargym has no subcommand {' '.join([*path, name])!r}"
        command = subcommand
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


def settings_classes(path: tuple[str, ...], params: dict[str, Any]) -> list[type[BaseSettings]]:
    """The settings classes that read the environment of ``stargym PATH``: the service's first, then
    for an env server those of its families (:data:`FAMILY_SETTINGS`)."""
    classes = [SUBCOMMAND_SETTINGS[path]]
    if path == ("env", "serve"):
        classes += [cls for family in params["families"] for cls in FAMILY_SETTINGS.get(family, ())]
    return classes


def load_service_settings(
    path: tuple[str, ...],
    params: dict[str, Any],
    environment: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    where: str = "",
) -> list[BaseSettings]:
    """Every class of :func:`settings_classes` as the service reads it, in that order.

    A variable with a family class's ``env_prefix`` goes to that class (``STARGYM_SCIWORLD_POOL_SIZE``
    to the JVM pool's), any other to the service's (``STARGYM_API_TOKEN``, ``REDIS_URL``), and
    :func:`load_settings` checks it there. One of a family's :data:`FAMILY_VARIABLES` must be what
    its reader returns when it is set (``STARGYM_CACHE_DIR`` for the search family).
    """
    classes = settings_classes(path, params)
    shares: dict[type[BaseSettings], dict[str, str]] = {cls: {} for cls in classes}
    families = params["families"] if path == ("env", "serve") else []
    readers = {var: read for family in families for var, read in FAMILY_VARIABLES.get(family, {}).items()}
    for var, value in environment.items():
        if var in readers:
            with monkeypatch.context() as patch:
                patch.setenv(var, value)
                assert str(readers[var]()) == value, f"{where}: {var}={value!r} reads {readers[var]()!r}"
            continue
        owner = next((cls for cls in classes[1:] if var.upper().startswith(_prefix(cls))), classes[0])
        shares[owner][var] = value
    found = []
    for cls, share in shares.items():
        with monkeypatch.context() as patch:
            found.append(load_settings(cls, share, patch, where))
    return found


def _prefix(settings: type[BaseSettings]) -> str:
    return settings.model_config.get("env_prefix", "").upper()


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
