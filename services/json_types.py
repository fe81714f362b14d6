"""Request field types that accept exactly what their JSON schema allows, no more, no less.

Request models validate in pydantic's strict mode (a schema-invalid ``true`` or ``"5"`` for an
integer is refused, as a client generated from the OpenAPI document would never send it). Strict
mode also refuses ``5.0``, which JSON Schema counts as an integer: :data:`WHOLE_FLOATS` takes it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def _whole_float_as_int(value: Any) -> Any:
    """``5.0`` is the integer 5 in JSON Schema; any other value is left to the int validator."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


WHOLE_FLOATS = BeforeValidator(_whole_float_as_int)
"""Metadata for a strict ``int`` field: ``Annotated[int, Field(ge=0), WHOLE_FLOATS]``. Last, so
that the JSON schema keeps the constraints before it (pydantic drops those set after a validator)."""


def _booleans_only(value: Any) -> Any:
    if type(value) is not bool:
        raise ValueError("Input should be a valid boolean")
    return value


BOOLEANS_ONLY = BeforeValidator(_booleans_only)
"""Metadata for a ``Literal[False]``: pydantic matches literals by equality, and ``0 == False``."""

JsonInt = Annotated[int, WHOLE_FLOATS]
"""An integer as JSON Schema has it: ``5`` or ``5.0``, never ``true`` or ``"5"`` (in a strict model)."""
