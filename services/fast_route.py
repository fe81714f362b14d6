"""A FastAPI route whose plainest, valid JSON requests skip FastAPI's request machinery.

For the requests a rollout makes on every turn (an env step or reset, an engine completion),
FastAPI's content-type parsing, dependency solving and body and response validation cost more
than the work they carry: several times an env step; on the engine server, whose HTTP side
shares one GIL with the engine thread, a one-token completion took 0.28 ms of the app's CPU
(the engine's own work aside) through the regular route and 0.20 ms through this one. A route of
this class is an ordinary route to routing, middleware and the OpenAPI schema; only its handler
looks at the body first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

LONG_NUMBER = re.compile(rb"[0-9]{19}")
"""19 digits in a row: orjson reads an integer past 64 bits as a float (-2**63 - 1 becomes
-9.2e18, which then validates as -2**63), so a body holding one goes to FastAPI, whose parser keeps
it exact; so does any other run of 19 digits, a rare body (found by the OpenAPI contract test)."""
NOT_PLAIN = object()
"""A body the fast path leaves to FastAPI."""
NO_BODY = object()
"""An empty body."""


class FastPathRoute(APIRoute):
    """An ``APIRoute`` whose subclass's :meth:`fast` answers the requests it can.

    :meth:`fast` gets the body as parsed JSON (:data:`NO_BODY` when empty) and answers when the
    body is one that FastAPI would accept unchanged; it returns None for anything else
    (malformed, extra fields, wrong types), which then goes to the regular FastAPI handler, as
    does a body that is not ``application/json`` or not JSON at all. So errors, their status
    codes and messages are exactly FastAPI's.
    """

    async def fast(self, request: Request, payload: Any) -> Response | None:
        raise NotImplementedError

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        regular = super().get_route_handler()

        async def handler(request: Request) -> Response:
            payload = _json_body(request, await request.body())
            response = None if payload is NOT_PLAIN else await self.fast(request, payload)
            return response if response is not None else await regular(request)

        return handler


def _json_body(request: Request, body: bytes) -> Any:
    """The body as JSON (:data:`NO_BODY` when empty), or :data:`NOT_PLAIN` when FastAPI must judge it."""
    if not body:
        return NO_BODY
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        return NOT_PLAIN
    if LONG_NUMBER.search(body):
        return NOT_PLAIN
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return NOT_PLAIN
