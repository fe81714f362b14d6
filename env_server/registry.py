"""Finding env classes: by entry point (group ``stargym.envs``) or by a path a user names.

Entry-point names are env ids (``game/sokoban``), so a family is selected by name prefix
without importing the other families' heavy dependencies.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

from env_server.core import Env

ENTRY_POINT_GROUP = "stargym.envs"
USER_MODULE_PREFIX = "stargym_user_env_"  # the module of an env loaded from a file path


class EnvLoadError(ValueError):
    """A family or env path that names nothing loadable; the message says what was looked for."""


def registered_ids() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def load_family(family: str) -> dict[str, type[Env]]:
    """Every registered env of ``family``, keyed by env id."""
    selected = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name.split("/", 1)[0] == family]
    if not selected:
        families = sorted({name.split("/", 1)[0] for name in registered_ids()})
        raise EnvLoadError(f"no registered env in family {family!r}; known families: {', '.join(families)}")
    classes = {}
    for ep in selected:
        try:
            loaded = ep.load()
        except Exception as exc:
            raise EnvLoadError(
                f"entry point {ep.name!r} ({ep.value}) fails to load: {_describe(exc)}"
            ) from exc
        env_class = _check(loaded, ep.value)
        if env_class.env_id() != ep.name:
            raise EnvLoadError(
                f"entry point {ep.name!r} loads {ep.value}, whose id is {env_class.env_id()!r}"
            )
        classes[ep.name] = env_class
    return dict(sorted(classes.items()))


def load_env_path(spec: str) -> type[Env]:
    """Load ``package.module:Class`` or ``path/to/file.py:Class``: a user's env written in one file."""
    target, sep, class_name = spec.rpartition(":")
    if not sep or not target or not class_name:
        raise EnvLoadError(f"env path {spec!r} must look like 'package.module:Class' or 'file.py:Class'")
    if target.endswith(".py"):
        module = _import_file(Path(target))
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")  # a module next to where the user runs the command
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # an error inside the user's module too, not only a missing one
            raise EnvLoadError(f"cannot import {target!r}: {_describe(exc)}") from exc
    try:
        loaded = getattr(module, class_name)
    except AttributeError:
        raise EnvLoadError(f"{target!r} has no attribute {class_name!r}") from None
    return _check(loaded, spec)


def load_envs(families: list[str], paths: list[str]) -> dict[str, type[Env]]:
    """The envs one server hosts: whole families plus individually named classes."""
    classes: dict[str, type[Env]] = {}
    for family in families:
        classes.update(load_family(family))
    for path in paths:
        env_class = load_env_path(path)
        classes[env_class.env_id()] = env_class
    if not classes:
        raise EnvLoadError("nothing to serve: name a family or an env path")
    return classes


def _import_file(path: Path):
    if not path.is_file():
        raise EnvLoadError(f"env file {str(path)!r} does not exist")
    module_name = f"{USER_MODULE_PREFIX}{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise EnvLoadError(f"cannot load env file {str(path)!r}: {_describe(exc)}") from exc
    return module


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _check(loaded: object, where: str) -> type[Env]:
    if not (isinstance(loaded, type) and issubclass(loaded, Env)):
        raise EnvLoadError(f"{where} is not a subclass of env_server.Env")
    missing = [
        attr
        for attr in ("name", "family", "instruction", "action_format", "default_max_turns", "reward_range")
        if not hasattr(loaded, attr)
    ]
    if missing:
        raise EnvLoadError(f"{where} lacks class metadata: {', '.join(missing)}")
    return loaded
