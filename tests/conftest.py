"""Fixtures shared by every test: free ports, real servers as subprocesses, health waits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.launcher import STARGYM, free_port, start_service, wait_healthy
from deploy.launcher import ServiceProcess as RunningServer
from deploy.launcher import stop_process as stop_server
from services.redis_local import LocalRedis, start_redis_server

REPO_ROOT = Path(__file__).resolve().parent.parent
__all__ = [
    "REPO_ROOT",
    "STARGYM",
    "RunningServer",
    "free_port",
    "start_server",
    "stop_server",
    "wait_healthy",
]


def start_server(
    args: list[str], port: int, tmp_path: Path, env: dict[str, str] | None = None, name: str = "server"
) -> RunningServer:
    """Start ``stargym ARGS`` from the repository root, its log in ``tmp_path``; wait for /health."""
    return start_service(name, args, port, tmp_path, env=env, cwd=REPO_ROOT)


@pytest.fixture(scope="session")
def game_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One real game env server for the whole session (uvicorn on a free loopback port)."""
    port = free_port()
    server = start_server(
        ["env", "serve", "game", "--port", str(port)], port, tmp_path_factory.mktemp("game"), name="game"
    )
    yield server
    stop_server(server.process)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """A private ``redis-server`` for the session: loopback, a free port, nothing on disk.

    ``start_redis_server`` picks the free port itself and picks again if another process takes
    it before Redis binds, which a port chosen here could not.
    """
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: LocalRedis) -> str:
    """URL of the session's Redis; tests that need a clean database flush it themselves."""
    return redis_server.url
