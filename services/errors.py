"""Errors that cross the wire.

Every service answers a failure with a real status code and the body
``{"error": {"code": ..., "message": ...}}``; raising :class:`ApiError` anywhere in a request
handler produces exactly that, so handlers never build error responses by hand.
"""

from __future__ import annotations

from pydantic import ValidationError


class ApiError(Exception):
    """A failure the client caused or must handle, carried to the HTTP edge unchanged."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


def not_found(what: str, key: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} {key!r} does not exist")


def conflict(code: str, message: str) -> ApiError:
    return ApiError(409, code, message)


def bad_request(code: str, message: str) -> ApiError:
    return ApiError(400, code, message)


def too_many(code: str, message: str) -> ApiError:
    return ApiError(429, code, message)


def validation_problems(exc: ValidationError, whole: str, limit: int = 5) -> str:
    """The first ``limit`` problems of a pydantic error as ``field.path: message; ...``, for the
    messages users read (an error about the model itself is named ``whole``)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or whole}: {error['msg']}"
        for error in exc.errors()[:limit]
    )
