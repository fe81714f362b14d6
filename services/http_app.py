"""The HTTP app factory every service uses: health, Prometheus metrics, JSON errors, size limit, auth.

The cross-cutting parts are plain ASGI middleware rather than ``BaseHTTPMiddleware``: they sit on
the hot path of every env step, and plain ASGI costs a few microseconds where the latter costs tens.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import hashlib
import hmac
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlencode

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import RouteContext, iter_route_contexts
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route, compile_path

from services.env_protocol import Health
from services.errors import ApiError
from services.openapi import complete_document, error_responses
from services.settings import ServiceSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = frozenset({"/health"})
ROUTING_NOT_FOUND = "Not Found"
"""Starlette's message when no route matches the path."""
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


def dumps_json(content: Any) -> bytes:
    """``content`` as JSON: orjson, or the stdlib encoder for what orjson refuses to write.

    That is a string holding a lone UTF-16 surrogate: JSON's ``"\\ud800"`` decodes to one, and
    an env echoes the action it refused. orjson raises on it (the answer would be a 500); the
    stdlib writes the same escape back, so the client reads exactly what it sent. Found by
    tests/integration/test_fuzz_steps.py; the fallback costs nothing on the usual path.
    """
    try:
        return orjson.dumps(content)
    except TypeError:
        return json.dumps(content).encode()


def model_json(model: BaseModel) -> str:
    """``model`` as JSON text (a WebSocket message), with :func:`dumps_json`'s fallback."""
    try:
        return model.model_dump_json()
    except PydanticSerializationError:
        return dumps_json(model.model_dump(mode="json")).decode()


class OrjsonResponse(JSONResponse):
    """JSON responses through orjson: several times faster than the stdlib encoder on step payloads."""

    def render(self, content: Any) -> bytes:
        return dumps_json(content)


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return OrjsonResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def send_error(
    send: Send, status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> None:
    """The error contract's response, sent by an ASGI middleware (no Response object there)."""
    body = dumps_json({"error": {"code": code, "message": message}})
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
        await send_error(send, 413, "payload_too_large", f"request body exceeds {self.max_bytes} bytes")


class _BodyTooLarge(StarletteHTTPException):
    """An HTTPException, so FastAPI's body parsing re-raises it instead of turning it into a 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds {max_bytes} bytes")


TOKEN_COOKIE = "stargym_token"
LOGIN_PATH = "/login"
_LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>stargym: sign in</title>
<style>body{font:15px system-ui,sans-serif;margin:12vh auto;max-width:22rem}input,button{font:inherit;
padding:.4rem;width:100%%;box-sizing:border-box;margin:.3rem 0}p.error{color:#b00020}</style></head>
<body><h1>stargym</h1><p>This service needs its API token (STARGYM_API_TOKEN).</p>%s
<form method="post" action="/login"><input type="password" name="token" placeholder="API token"
autocomplete="current-password" autofocus required><button type="submit">Sign in</button></form></body></html>"""


class TokenAuth:
    """Requires the API token on every path but /health and /login; compares in constant time.

    Programs send ``Authorization: Bearer <token>``. A browser signs in once, through the login
    form (``POST /login``) or a link with ``?token=<token>``; both set an HttpOnly, SameSite=Strict
    cookie holding an HMAC of the token, and ``?token=`` is answered with a redirect to the same
    URL without it, so the token does not stay in the address bar or the history. An
    unauthenticated request that accepts HTML gets the login form, with status 401; any other
    gets the JSON 401.
    """

    def __init__(
        self, app: ASGIApp, token: str, public_paths: frozenset[str] = UNAUTHENTICATED_PATHS
    ) -> None:
        self.app = app
        self.public_paths = public_paths
        self.token = token.encode()
        self.expected = b"Bearer " + self.token
        # The cookie holds a digest of the token, not the token: it is cookie-safe whatever
        # characters the token has, and the browser never stores the token itself.
        self.cookie_value = hmac.new(self.token, b"stargym sign-in cookie", hashlib.sha256).hexdigest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        if scope["path"] == LOGIN_PATH:
            await self._login(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected) or self._cookie_ok(headers.get(b"cookie", b"")):
            await self.app(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        if "token" in query and hmac.compare_digest(query["token"][-1].encode(), self.token):
            rest = urlencode(
                [(k, v) for k, values in query.items() if k != "token" for v in values], doseq=True
            )
            path = scope.get("raw_path") or scope["path"].encode()
            await self._signed_in(send, path.decode("latin-1") + (f"?{rest}" if rest else ""))
            return
        if b"text/html" in headers.get(b"accept", b""):
            await self._login_page(send, 401, "")
            return
        message = "missing bearer token" if not given else "invalid bearer token"
        await send_error(send, 401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket (an OpenEnv session) needs the token too: as the bearer header, or as
        ``?token=`` for clients that cannot set headers. Refused before the handshake completes,
        which the client sees as HTTP 403."""
        headers = dict(scope["headers"])
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = headers.get(b"authorization", b"")
        in_query = query.get("token", [""])[-1].encode()
        if hmac.compare_digest(given, self.expected) or hmac.compare_digest(in_query, self.token):
            await self.app(scope, receive, send)
            return
        await receive()  # the client's websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": "missing or invalid API token"})

    def _cookie_ok(self, header: bytes) -> bool:
        cookies = SimpleCookie()
        try:
            cookies.load(header.decode("latin-1"))
        except CookieError:
            return False
        morsel = cookies.get(TOKEN_COOKIE)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), self.cookie_value.encode())

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await self._login_page(send, 200, "")
            return
        body = b""
        while True:  # BodySizeLimit (outside this middleware) bounds what arrives
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        token = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[-1]
        if hmac.compare_digest(token.encode(), self.token):
            await self._signed_in(send, "/")
        else:
            await self._login_page(send, 401, '<p class="error">Wrong token.</p>')

    async def _signed_in(self, send: Send, location: str) -> None:
        cookie = f"{TOKEN_COOKIE}={self.cookie_value}; Path=/; HttpOnly; SameSite=Strict"
        headers = [(b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode("latin-1"))]
        await send(
            {"type": "http.response.start", "status": 303, "headers": [*headers, (b"content-length", b"0")]}
        )
        await send({"type": "http.response.body", "body": b""})

    async def _login_page(self, send: Send, status: int, notice: str) -> None:
        body = (_LOGIN_PAGE % notice).encode()
        headers = [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


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
            # The template as documented: /instances/{instance_id}, not its converter's spelling.
            template = (
                route.path_format if isinstance(route, Route | RouteContext) else getattr(route, "path", None)
            )
            template = template or "unmatched"
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


class GcPauses:
    """Times every pass of Python's cyclic collector into ``python_gc_pause_seconds{generation}``.

    A collection stops the event loop: every request in flight waits for it, so its pauses are
    the first suspect of a long latency tail. Counting them (prometheus_client's own GC collector
    does) does not show how long they last; this does, on every service's /metrics, which is
    also how ``bench/load.py`` compares the start-up heap frozen and not. Registered on
    ``gc.callbacks`` only while the app runs (its lifespan), so a stopped app leaves no hook.

    The callback only adds to plain lists and a scrape reads them (a custom collector): a
    prometheus_client ``Histogram`` takes a non-reentrant lock, and a collection that started
    while this thread held it would wait on itself for ever.
    """

    BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(3)]  # per bucket, +Inf last
        self._sums = [0.0] * 3
        self._started = 0.0
        registry.register(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        paused = time.perf_counter() - self._started
        generation = info["generation"]
        self._sums[generation] += paused
        self._counts[generation][bisect.bisect_left(self.BUCKETS, paused)] += 1

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "python_gc_pause_seconds",
            "Time Python's cyclic garbage collector stopped the process, per generation collected",
            labels=["generation"],
        )
        for generation in range(3):
            cumulative = list(itertools.accumulate(self._counts[generation]))
            bounds = [*map(str, self.BUCKETS), "+Inf"]
            family.add_metric(
                [str(generation)], list(zip(bounds, cumulative, strict=True)), self._sums[generation]
            )
        yield family

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


def create_app(
    service: str,
    settings: ServiceSettings,
    *,
    version: str = "0.1.0",
    description: str = "",
    lifespan: Callable[[FastAPI], Any] | None = None,
    unhealthy: Callable[[FastAPI], str | None] | None = None,
    inner_middleware: Sequence[type[Any]] = (),
    mounted: Sequence[str] = (),
) -> FastAPI:
    """A FastAPI app with stargym's shared behaviour; the caller adds its own routers.

    ``app.state.metrics_registry`` is the Prometheus registry served on /metrics; services
    register their own collectors on it. ``unhealthy(app)`` says why the service cannot do its
    work now (None: it can), and turns /health into a 503 with that reason: what a load balancer,
    a readiness probe and the dashboard need to see, where a process that merely answers would
    look fine. ``inner_middleware`` (ASGI middleware classes, outermost first) run inside the size
    limit, the API token check and the request metrics, before routing: a service's fast paths.
    ``mounted``: the prefixes where the caller mounts apps of their own; their /health needs no
    token either (their other routes are behind this app's token).
    """
    public_paths = UNAUTHENTICATED_PATHS | {
        prefix + path for prefix in mounted for path in UNAUTHENTICATED_PATHS
    }
    registry = CollectorRegistry()
    app = FastAPI(
        title=f"stargym {service}",
        version=version,
        description=description,
        lifespan=_freezing_the_startup_heap(lifespan, GcPauses(registry)),
        default_response_class=OrjsonResponse,
    )
    app.state.metrics_registry = registry
    app.state.settings = settings
    _install_error_handlers(app)
    complete_document(app, authenticated=settings.api_token is not None, public_paths=public_paths)

    @app.get("/health", response_model=Health, tags=["service"], responses=error_responses(503))
    async def health(request: Request) -> Any:
        reason = unhealthy(request.app) if unhealthy is not None else None
        if reason is not None:
            return error_response(503, "unhealthy", reason)
        return Health(service=service, version=version, launch_id=settings.launch_id)

    @app.get("/metrics", tags=["service"], response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # Starlette wraps in reverse order of addition: the size limit and auth run before any route.
    for middleware in reversed(inner_middleware):
        app.add_middleware(middleware)
    app.add_middleware(RequestMetrics, registry=registry, service=service)
    if settings.api_token is not None:
        app.add_middleware(TokenAuth, token=settings.api_token.get_secret_value(), public_paths=public_paths)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app


def _freezing_the_startup_heap(
    lifespan: Callable[[FastAPI], Any] | None, pauses: GcPauses
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """``lifespan``, then ``gc.freeze()`` once the service has started, before the first request.

    Python's full collections walk every tracked object, and a started service holds hundreds of
    thousands that live as long as it does (modules, pydantic schemas, torch and transformers,
    the model). Frozen, they are never walked again; a collection then walks only what requests
    allocated since, so its pause shrinks with the heap it no longer walks. From then on, until
    the app stops, ``pauses`` times every collection.
    """

    @asynccontextmanager
    async def frozen(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else contextlib.nullcontext():
            gc.collect()
            gc.freeze()
            log.debug("froze %d objects allocated at start-up", gc.get_freeze_count())
            with pauses.installed():
                yield

    return frozen


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(422, "validation_error", _describe_validation(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = STATUS_CODES.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        message = str(exc.detail)
        if exc.status_code == 404 and message == ROUTING_NOT_FOUND:
            # What was asked for, e.g. an instance path whose id cannot be one (ids are UUIDs).
            message = f"nothing at {request.method} {request.url.path}"
        allowed = allowed_methods(request) if exc.status_code == 405 else None
        if allowed:  # else as raised (a mount, such as static files, knows its own)
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return error_response(exc.status_code, code, message, headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500, "internal_error", f"internal error ({type(exc).__name__}); see the server log"
        )


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path, for the ``Allow`` of a 405.

    Starlette's 405 lists the methods of the first route whose path matched, but ``GET`` and
    ``POST /instances`` are two routes: each would hide the other. The table of paths and
    methods is built at the app's first 405 (routers nest; FastAPI walks them for us).
    """
    table = getattr(request.app.state, "route_methods", None)
    if table is None:
        table = request.app.state.route_methods = [
            (compile_path(route.path)[0], frozenset(route.methods))
            for route in iter_route_contexts(request.app.routes)
            if route.methods and route.path
        ]
    path = request.scope["path"]
    return sorted({method for pattern, methods in table if pattern.match(path) for method in methods})


def _describe_validation(errors: Any) -> str:
    """One readable line per problem, e.g. "body.seed: Input should be a valid integer"."""
    parts = []
    for error in errors:
        location = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(
            f"{location}: {error.get('msg', 'invalid')}" if location else error.get("msg", "invalid")
        )
    return "; ".join(parts) or "invalid request"
