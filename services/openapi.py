"""The OpenAPI document as a contract: every status a route answers is in it, with its body.

Clients are generated from ``/openapi.json`` and schemathesis holds every service to it
(tests/integration/test_openapi_contract.py), so a status a route can answer and the document
omits is a bug of the document. Two sources of statuses, two mechanisms:

* what a route's own logic refuses (an unknown instance, a full server, a finished episode) the
  route lists itself, with :func:`error_responses`;
* what the shared machinery of :func:`services.http_app.create_app` answers before or around any
  handler (a body that is not JSON, a failed validation, the size limit, the API token) is added
  to every operation it applies to by :func:`complete_document`, once, when the document is
  first built: no route repeats it, and none can forget it.

Every error has the one body of :class:`services.env_protocol.ErrorResponse`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from fastapi import FastAPI

from services.env_protocol import ErrorResponse

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Refused: the message says why.",
    401: "The API token is missing or wrong (this service has STARGYM_API_TOKEN set).",
    403: "Not allowed: the message says why.",
    404: "Not found: the message names what.",
    409: "Conflicts with the state of what it acts on: the message says how.",
    413: "The request body is larger than this service's STARGYM_MAX_BODY_BYTES.",
    422: "The request does not match this schema: the message names each problem.",
    429: "At a limit of this service: try again later.",
    502: "An env failed while serving the request; its instance is closed.",
    503: "The service cannot do its work now: the message says why.",
}
BODY_NOT_JSON = "The body is not JSON (not UTF-8 text, or not parseable)."
BEYOND_SCHEMA = "x-stargym-beyond-schema"
"""On a response: the error codes it carries for requests its schema allows (see :func:`refusals`)."""
SECURITY_SCHEME = "bearer"
BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
"""FastAPI's own 422 body, replaced by ours everywhere, so it leaves the document."""

_ERROR_REF = {"$ref": f"#/components/schemas/{ErrorResponse.__name__}"}


def error_responses(*statuses: int, descriptions: Mapping[int, str] | None = None) -> dict[int | str, Any]:
    """FastAPI ``responses=`` for error statuses of a route, each with the JSON error body;
    ``descriptions`` says what a status means on this route where the generic text is vague."""
    descriptions = descriptions or {}
    return {
        status: {"model": ErrorResponse, "description": descriptions.get(status, ERROR_DESCRIPTIONS[status])}
        for status in statuses
    }


def refusals(status: int, codes: Mapping[str, str]) -> dict[int | str, Any]:
    """FastAPI ``responses=`` for a status a route also answers to requests its schema allows.

    Some rules no JSON Schema states: an env's options that fail the env's own checks (one field
    against another, a seed its generator cannot make a task from), a prompt that with its
    ``max_tokens`` overflows the context. ``codes`` names each error code such a refusal carries
    and what it means; the response lists them under ``x-stargym-beyond-schema``, so a client,
    and the contract test, can tell a refusal by such a rule from a request that broke the schema.
    """
    lines = "; ".join(f"{code}: {meaning}" for code, meaning in codes.items())
    return {
        status: {
            "model": ErrorResponse,
            "description": f"{ERROR_DESCRIPTIONS[status]} Also, for requests the schema allows: {lines}",
            BEYOND_SCHEMA: sorted(codes),
        }
    }


def complete_document(app: FastAPI, *, authenticated: bool, public_paths: Collection[str]) -> None:
    """Make ``app``'s document list the statuses of the shared machinery on each operation, and
    state its integer bounds exactly.

    Any parameter or body: 422 (validation). A body: also 400 (not JSON) and 413 (size limit).
    ``authenticated`` (the API token is on): 401 on every path but ``public_paths``, and the
    bearer scheme declared, so clients know to send it.
    """

    def complete(document: dict[str, Any]) -> None:
        _add_shared_errors(document, authenticated, public_paths)
        _exact_bounds(document)

    extend_openapi(app, complete)


def extend_openapi(app: FastAPI, extend: Callable[[dict[str, Any]], None]) -> None:
    """Run ``extend`` on ``app``'s OpenAPI document once, when FastAPI first builds it (it caches it)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            extend(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_shared_errors(schema: dict[str, Any], authenticated: bool, public_paths: Collection[str]) -> None:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name, definition in _error_schemas().items():
        schemas.setdefault(name, definition)
    for name in FASTAPI_VALIDATION_SCHEMAS:
        schemas.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for response in responses.values():
                _errors_as_json(response)
            has_body = "requestBody" in operation
            if has_body:
                _document(responses, 400, BODY_NOT_JSON)
                _document(responses, 413)
            if has_body or operation.get("parameters"):
                if not _is_error_response(responses.get("422")):  # FastAPI's own body: ours replaces it
                    responses["422"] = _error_response(ERROR_DESCRIPTIONS[422])
            else:
                responses.pop("422", None)
            if authenticated:
                if path in public_paths:
                    operation["security"] = []
                else:
                    _document(responses, 401)
    if authenticated:
        components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": "The service's STARGYM_API_TOKEN, as 'Authorization: Bearer <token>'.",
        }
        schema["security"] = [{SECURITY_SCHEME: []}]


def _exact_bounds(node: Any) -> None:
    """Whole-number bounds as JSON integers: FastAPI writes every bound as a float, and past 2**53
    a float is not the bound (a seed's ``lt=2**63`` read back as a float admits 2**63 + 190)."""
    if isinstance(node, dict):
        for key in BOUNDS.intersection(node):
            if isinstance(node[key], float) and node[key].is_integer():
                node[key] = int(node[key])
        for value in node.values():
            _exact_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_bounds(value)


def _document(responses: dict[str, Any], status: int, description: str | None = None) -> None:
    """Add ``status`` with the error body unless the route documented it itself."""
    responses.setdefault(str(status), _error_response(description or ERROR_DESCRIPTIONS[status]))


def _errors_as_json(response: dict[str, Any]) -> None:
    """An error is JSON whatever the route's own responses are: FastAPI documents a route's error
    models under its response class's media type (text/html for a page)."""
    content = response.get("content", {})
    if any(media.get("schema") == _ERROR_REF for media in content.values()):
        response["content"] = {"application/json": {"schema": _ERROR_REF}}


def _is_error_response(response: dict[str, Any] | None) -> bool:
    """Documented with our error body (by the route), not FastAPI's validation body."""
    content = (response or {}).get("content", {})
    return content.get("application/json", {}).get("schema") == _ERROR_REF


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _error_schemas() -> dict[str, Any]:
    """ErrorResponse and what it refers to, as component schemas."""
    schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {**definitions, ErrorResponse.__name__: schema}
