"""``POST /instances/{id}/step`` answered before Starlette routes the request.

Every turn of every rollout is this request, and for it the web stack cost more than the env: a
TextCraft step is ~15 µs, while Starlette's routing (a regex per route, tried in order: an env
server has AgentGym routes for each of its envs, hundreds on the reasoning server), its request
wrappers and FastAPI's per-request exit stack cost ~250 µs (py-spy, issue 14). Under wrk with 64
connections the server stepped ~2,700 times a second with p50 24 ms and p99 34 ms.

:class:`StepFastPath` runs inside the size limit, the API token check and the request metrics
(:func:`services.http_app.create_app`'s ``inner_middleware``), so none of those is skipped. It
answers a step whose body is exactly ``{"action": "<text>"}`` with ``Content-Type:
application/json`` itself; any other request at that path (another content type, extra fields,
a wrong type, not JSON) goes on, its body replayed, to the ordinary route, whose validation and
error messages stay FastAPI's. Errors of the step itself are :class:`~services.errors.ApiError`
(404, 409, 502) and get the error contract's body here; anything else propagates to the app's
handler of unexpected errors, as from a route.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from fastapi.routing import RouteContext, iter_route_contexts

from env_server.routes import STEP_PATH_FORMAT, step_payload
from services.env_protocol import INSTANCE_ID_PATTERN
from services.errors import ApiError
from services.http_app import ASGIApp, Message, Receive, Scope, Send, dumps_json, send_error

STEP_PATH = re.compile(f"/instances/(?P<instance_id>{INSTANCE_ID_PATTERN})/step")
JSON_HEADERS = [(b"content-type", b"application/json")]


class StepFastPath:
    """ASGI middleware: a plain JSON step goes straight to the pool; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._route: RouteContext | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = (
            STEP_PATH.fullmatch(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if match is None or not _is_json(scope["headers"]):
            await self.app(scope, receive, send)
            return
        body, complete = await _read_body(receive)
        action = _plain_action(body) if complete else None
        if action is None:
            await self.app(scope, _replaying(body, complete, receive), send)
            return
        scope["route"] = self._step_route(scope)  # the request metrics' route template
        try:
            step = await scope["app"].state.pool.step(match["instance_id"], action)
        except ApiError as exc:
            await send_error(send, exc.status, exc.code, exc.message)
            return
        payload = dumps_json(step_payload(step))
        headers = [*JSON_HEADERS, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    def _step_route(self, scope: Scope) -> RouteContext:
        """The app's step route, found once: the request is still counted under its template."""
        if self._route is None:
            routes = iter_route_contexts(scope["app"].routes)
            found = [route for route in routes if route.path_format == STEP_PATH_FORMAT]
            if len(found) != 1:
                raise LookupError(f"the app has {len(found)} routes {STEP_PATH_FORMAT}, not one")
            self._route = found[0]
        return self._route


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.partition(b";")[0].strip().lower() == b"application/json"
    return False


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole body, and False when the client went away before sending it all."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _plain_action(body: bytes) -> str | None:
    """The action of a body that is exactly ``{"action": "<text>"}``; None for anything else."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(payload) is not dict or len(payload) != 1:
        return None
    action = payload.get("action")
    return action if type(action) is str else None


def _replaying(body: bytes, complete: bool, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body already read, then the client's next messages
    (after an incomplete body, its disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": not complete}

    return replay
