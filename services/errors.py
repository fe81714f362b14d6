"""Errors that cross the wire.

Every service answers a failure with a real status code and the body
``{"error": {"code": ..., "message": ...}}``; raising :class:`ApiError` anywhere in a request
handler produces exactly that, so handlers never build error responses by hand.
"""

from __future__ import annotations


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
