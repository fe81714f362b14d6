"""A pydantic model of each reasoning-gym config dataclass: the ``config`` option of an env.

reasoning-gym's configs are dataclasses with defaults and a ``validate()`` of asserts. The model
has the same fields, types and defaults (so the options schema of ``GET /envs`` shows them, with
the descriptions the config's source gives in comments or its docstring), rejects unknown keys,
and runs ``validate()``: a config reasoning-gym refuses is a validation error, which the host
answers with 422 and reasoning-gym's message. ``seed`` and ``size`` are not options: the env sets
them (see :mod:`.catalog`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from env_server.envs.reasoning.catalog import DatasetInfo

SET_BY_THE_ENV = frozenset({"seed", "size"})
BASE_SEED = 0  # every dataset is built with this seed; the env's seed picks the item

# Annotations whose own default fails them (defaults are validated): rearc's `diff_ub: int = 0.2`.
ANNOTATION_FIXES: dict[tuple[str, str], Any] = {("rearc", "diff_ub"): float}
# A docstring line about a field: "name: text", "- name: text", ":param name: text", "name (type): text".
_DOC_LINE = re.compile(
    r"^[ \t]*(?:[-*][ \t]*|:param[ \t]+)?(?P<name>\w+)[ \t]*(?:\([^)]*\))?[ \t]*:[ \t]*(?P<text>\S.*)$",
    re.MULTILINE,
)


def describe_fields(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Add the config source's field descriptions to ``model``'s JSON schema. Read only when a
    schema is made (``GET /envs``), not at import: reading the 103 configs' source takes 1.4 s
    of the server's start on this machine, twice the rest of making the classes."""
    config_class = getattr(model, "config_class", None)
    if config_class is None:
        return
    for name, text in field_descriptions(config_class).items():
        schema["properties"].get(name, {}).setdefault("description", text)


class DatasetConfig(BaseModel):
    """Base of the generated config models: strict keys, and reasoning-gym's own validation.

    Defaults are validated too, so a value always has its field's type (basic_arithmetic's
    ``operators: list[str]`` defaults to a tuple) and options dump to JSON without warnings.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, json_schema_extra=describe_fields)

    config_class: ClassVar[type[Any]]
    item_count: ClassVar[int]

    def dataclass_config(self) -> Any:
        """The reasoning-gym config these options stand for, with the env's seed and size."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        return self.config_class(**values, seed=BASE_SEED, size=self.item_count)

    @model_validator(mode="after")
    def reasoning_gym_accepts(self) -> DatasetConfig:
        try:
            config = self.dataclass_config()
            if hasattr(config, "validate"):  # power_function's and tsumego's configs have none
                config.validate()
        except Exception as exc:  # asserts mostly; some raise ValueError, a few TypeError on odd values
            raise ValueError(f"reasoning-gym refuses this config: {str(exc) or type(exc).__name__}") from None
        return self


def config_model(info: DatasetInfo) -> type[DatasetConfig]:
    """The options model of ``info``'s config dataclass (named like it, e.g. ``MazeConfig``)."""
    config_class = info.config_class
    hints = typing.get_type_hints(config_class)
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(config_class):
        if field.name in SET_BY_THE_ENV:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        annotation = ANNOTATION_FIXES.get((info.name, field.name), hints[field.name])
        fields[field.name] = (annotation, Field(default=default))
    model = create_model(
        config_class.__name__,
        __base__=DatasetConfig,
        __module__=__name__,
        __doc__=f"reasoning-gym's config of {info.name}.",
        **fields,
    )
    model.config_class = config_class
    model.item_count = info.item_count
    return model


@functools.cache
def field_descriptions(config_class: type) -> dict[str, str]:
    """What the config's source says about each field: a line of its docstring (``- min_dist:
    Minimum distance ...``), else the field's end-of-line comment in the class body
    (``max_word_length: int = 4  # Maximum word length``; some comments are history, "New
    parameter", which is why the docstring wins)."""
    names = {field.name for field in dataclasses.fields(config_class)}
    found: dict[str, str] = {}
    source = textwrap.dedent(inspect.getsource(config_class))
    line: list[tokenize.TokenInfo] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NEWLINE, tokenize.NL):
            line = []
        elif token.type == tokenize.COMMENT:
            if len(line) >= 2 and line[0].string in names and line[1].string == ":":
                found[line[0].string] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.INDENT, tokenize.DEDENT):
            line.append(token)
    for match in _DOC_LINE.finditer(inspect.getdoc(config_class) or ""):
        if match["name"] in names:
            found[match["name"]] = match["text"].strip()
    return found
