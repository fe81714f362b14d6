"""Our servers keep an idle connection open longer than clients pool one
(``services.serving.KEEP_ALIVE_S``).

httpx, and so the openai package, reuses a connection idle for up to 5 s; our own client up to
4 s. At uvicorn's default keep-alive, 5 s, the server could close such a connection just as a
request was sent on it, more so when either side stalled on a loaded machine: the request was
dropped unanswered (CI's leak test: "Server disconnected without sending a response" after a 5 s
idle), and a step or completion cannot be re-sent.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import start_family_server, stop_server

# Longer than any client here pools an idle connection.
IDLE_S = 6.0


async def test_an_idle_connection_stays_open_past_the_clients_pool_expiry(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = start_family_server("game", tmp_path_factory)
    try:
        limits = httpx.Limits(keepalive_expiry=60.0)  # the client keeps it; the server must too
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0, limits=limits) as http:
            first = await http.get("/instances")
            await asyncio.sleep(IDLE_S)
            second = await http.get("/instances")
            assert first.status_code == second.status_code == 200
            # httpx drops a pooled connection the server has closed and opens another.
            assert second.extensions["network_stream"] is first.extensions["network_stream"], (
                f"the server closed a connection idle for {IDLE_S} s"
            )
    finally:
        stop_server(server.process)
