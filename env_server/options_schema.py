"""The options each env takes, as JSON schemas: in ``GET /envs`` and in the server's OpenAPI document.

The routes' models type ``options`` as any object, since which options are valid depends on the
env: the create names it, a reset's is its instance's. A client generated from a document saying
only that could send anything, and the env would refuse most of it (422 ``invalid_options``). So
each server's document, built for the envs it hosts, says exactly what they take: the body of
``POST /instances`` is one shape per env (``env`` picks it, the options are that env's), and a
reset's options are those of one of the server's envs. The host still validates them per env.

The host's own validation (``env_server.pool.parse_options``) is pydantic's lax mode, which takes
``0`` for a boolean and ``"5"`` for an integer: options the schema refuses. The routes first check
the options' JSON types exactly, with :func:`check_option_types`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI

from env_server.core import Env
from env_server.pool import HostOptions
from services.errors import ApiError
from services.openapi import extend_openapi

COMPONENTS = "#/components/schemas/"


def options_schema(env_class: type[Env], ref_template: str = "#/$defs/{model}") -> dict[str, Any]:
    """The JSON schema of the options ``env_class`` takes: its own and the host's (HostOptions)."""
    schema = env_class.Options.model_json_schema(ref_template=ref_template)
    schema.setdefault("properties", {}).update(HostOptions.model_json_schema()["properties"])
    return schema


def document_env_options(app: FastAPI, env_classes: dict[str, type[Env]]) -> None:
    """Give ``app``'s document the create body per env and the reset options of any env."""
    extend_openapi(app, lambda document: _add_env_options(document["components"]["schemas"], env_classes))


def _add_env_options(components: dict[str, Any], env_classes: dict[str, type[Env]]) -> None:
    create = components["CreateInstance"]
    variants: dict[str, str] = {}
    options_refs = []
    for env_id, env_class in env_classes.items():
        prefix = env_id.replace("/", ".")  # a component name takes no '/'
        schema = options_schema(env_class, ref_template=f"{COMPONENTS}{prefix}.{{model}}")
        for name, definition in schema.pop("$defs", {}).items():
            components[f"{prefix}.{name}"] = definition
        components[f"{prefix}.Options"] = schema
        options_ref = {"$ref": f"{COMPONENTS}{prefix}.Options"}
        options_refs.append(options_ref)
        properties = {
            **create["properties"],
            "env": {"type": "string", "const": env_id},
            "options": {"anyOf": [options_ref, {"type": "null"}]},
        }
        components[f"CreateInstance.{prefix}"] = {
            **create,
            "title": f"CreateInstance {env_id}",
            "properties": properties,
        }
        variants[env_id] = f"{COMPONENTS}CreateInstance.{prefix}"
    components["CreateInstance"] = {
        "title": "CreateInstance",
        "description": "The env's id, and options of that env (each env's are in GET /envs too).",
        "oneOf": [{"$ref": ref} for ref in variants.values()],
        "discriminator": {"propertyName": "env", "mapping": variants},
    }
    options = components["ResetRequest"]["properties"]["options"]
    options["anyOf"] = [*options_refs, {"type": "null"}]


def check_option_types(env_class: type[Env], options: dict[str, Any] | None) -> None:
    """Refuse (422 ``invalid_options``) options whose JSON types are not those of the env's schema.

    Only the types: the values' constraints are the env's model's to check, after this. pydantic's
    strict mode would check both, but env models fill in defaults of their own (a dataclass's
    tuples for list fields) that strict mode then refuses, so the schema is walked instead.
    """
    if not options:
        return
    schema = _cached_schema(env_class)
    problems = list(_type_problems(options, schema, schema.get("$defs", {}), ""))
    if problems:
        raise ApiError(422, "invalid_options", f"{env_class.env_id()}: {'; '.join(problems[:5])}")


@functools.cache
def _cached_schema(env_class: type[Env]) -> dict[str, Any]:
    return options_schema(env_class)


def _json_types(value: Any) -> set[str]:
    """The JSON Schema types ``value`` (parsed JSON) is an instance of: 5.0 is an integer too."""
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    return {_PYTHON_TYPES[type(value)]}


_PYTHON_TYPES = {str: "string", type(None): "null", list: "array", dict: "object"}


def _type_problems(value: Any, schema: dict[str, Any], defs: dict[str, Any], where: str) -> Iterator[str]:
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        if all(any(_type_problems(value, option, defs, where)) for option in alternatives):
            yield f"{where or 'options'}: no type of its schema fits {value!r}"
        return
    allowed = schema.get("type")
    if "const" in schema or "enum" in schema:  # a Literal: pydantic takes 0 for false
        allowed = allowed or {
            _json_types(member).pop() for member in schema.get("enum", [schema.get("const")])
        }
    if allowed is not None:
        allowed = {allowed} if isinstance(allowed, str) else set(allowed)
        if not _json_types(value) & allowed:
            yield f"{where or 'options'}: Input should be of type {' or '.join(sorted(allowed))}"
            return
    if isinstance(value, dict):
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                yield from _type_problems(item, sub, defs, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        for index, item in enumerate(value):
            sub = prefix[index] if index < len(prefix) else schema.get("items")
            if isinstance(sub, dict):
                yield from _type_problems(item, sub, defs, f"{where}.{index}")
