"""Fixtures shared by every test: free ports, real servers as subprocesses, health waits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
STARGYM = [sys.executable, "-m", "deploy"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, deadline_s: float = 60.0, headers=None) -> None:
    """Poll ``url``/health until it answers 200; fail early if the process died."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {deadline_s} s")


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    args: list[str], port: int, tmp_path: Path, env: dict[str, str] | None = None, name: str = "server"
) -> RunningServer:
    """Start ``stargym ARGS`` with its output in a log file and wait for /health."""
    log_path = tmp_path / f"{name}-{port}.log"
    full_env = {**os.environ, **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*STARGYM, *args], stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
    except Exception:
        stop_server(process)
        raise RuntimeError(f"{name} failed to start:\n{log_path.read_text(errors='replace')}") from None
    return RunningServer(url, process, log_path)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def game_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One real game env server for the whole session (uvicorn on a free loopback port)."""
    port = free_port()
    server = start_server(
        ["env", "serve", "game", "--port", str(port)], port, tmp_path_factory.mktemp("game"), name="game"
    )
    yield server
    stop_server(server.process)


from services.redis_local import LocalRedis, start_redis_server  # noqa: E402  (appended with its fixtures)


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
