"""The HTTP app factory every service uses: health, Prometheus metrics, JSON errors, size limit, auth.

The cross-cutting parts are plain ASGI middleware rather than ``BaseHTTPMiddleware``: they sit on
the hot path of every env step, and plain ASGI costs a few microseconds where the latter costs tens.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.env_protocol import ErrorResponse, Health
from services.errors import ApiError
from services.settings import ServiceSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = frozenset({"/health"})
STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "validation_error",
    429: "too_many_requests",
}


class OrjsonResponse(JSONResponse):
    """JSON responses through orjson: several times faster than the stdlib encoder on step payloads."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return OrjsonResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def _send_error(
    send: Send, status: int, code: str, message: str, headers: dict[str, str] | None = None
):
    body = orjson.dumps({"error": {"code": code, "message": message}})
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """Answers 413 to bodies over ``max_bytes``, by declared length or by what actually arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                declared = int(value)
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None and not chunked:
            # The server reads no more than the declared length, so there is nothing to count:
            # skipping the wrappers below saves two calls per message on every request.
            await self.app(scope, receive, send)
            return
        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not response_started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        await _send_error(send, 413, "payload_too_large", f"request body exceeds {self.max_bytes} bytes")


class _BodyTooLarge(StarletteHTTPException):
    """An HTTPException, so FastAPI's body parsing re-raises it instead of turning it into a 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds {max_bytes} bytes")


class BearerAuth:
    """Requires ``Authorization: Bearer <token>`` on every path but /health; compares in constant time."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing bearer token" if not given else "invalid bearer token"
                await _send_error(send, 401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class RequestMetrics:
    """Counts requests and times them per route template (not per URL, so ids don't explode labels)."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry, service: str) -> None:
        self.app = app
        self.requests = Counter(
            "http_requests",
            "HTTP requests served",
            ["service", "method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "Time to answer an HTTP request",
            ["service", "route"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.service = service
        # Label children by label values: ``labels()`` validates and locks on every call.
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            key = (scope["method"], template, status)
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters[key] = self.requests.labels(
                    self.service, scope["method"], template, str(status)
                )
            counter.inc()
            timer = self._timers.get(template)
            if timer is None:
                timer = self._timers[template] = self.latency.labels(self.service, template)
            timer.observe(time.perf_counter() - start)


def create_app(
    service: str,
    settings: ServiceSettings,
    *,
    version: str = "0.1.0",
    description: str = "",
    lifespan: Callable[[FastAPI], Any] | None = None,
) -> FastAPI:
    """A FastAPI app with stargym's shared behaviour; the caller adds its own routers.

    ``app.state.metrics_registry`` is the Prometheus registry served on /metrics; services
    register their own collectors on it.
    """
    app = FastAPI(
        title=f"stargym {service}",
        version=version,
        description=description,
        lifespan=lifespan,
        default_response_class=OrjsonResponse,
        responses={422: {"model": ErrorResponse}},
    )
    registry = CollectorRegistry()
    app.state.metrics_registry = registry
    app.state.settings = settings
    _install_error_handlers(app)

    @app.get("/health", response_model=Health, tags=["service"])
    async def health() -> Health:
        return Health(service=service, version=version)

    @app.get("/metrics", tags=["service"], response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # Starlette wraps in reverse order of addition: the size limit and auth run before any route.
    app.add_middleware(RequestMetrics, registry=registry, service=service)
    if settings.api_token is not None:
        app.add_middleware(BearerAuth, token=settings.api_token.get_secret_value())
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(422, "validation_error", _describe_validation(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = STATUS_CODES.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500, "internal_error", f"internal error ({type(exc).__name__}); see the server log"
        )


def _describe_validation(errors: Any) -> str:
    """One readable line per problem, e.g. "body.seed: Input should be a valid integer"."""
    parts = []
    for error in errors:
        location = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(
            f"{location}: {error.get('msg', 'invalid')}" if location else error.get("msg", "invalid")
        )
    return "; ".join(parts) or "invalid request"
