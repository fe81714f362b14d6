"""Fixtures shared by every test: free ports, real servers as subprocesses, health waits."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis

from deploy.launcher import STARGYM, free_port, poll_client, start_service, wait_healthy
from deploy.launcher import ServiceProcess as RunningServer
from deploy.launcher import stop_process as stop_server
from deploy.redis_local import LocalRedis, start_redis_server

REPO_ROOT = Path(__file__).resolve().parent.parent
__all__ = [
    "POLL",
    "REPO_ROOT",
    "STARGYM",
    "RunningServer",
    "create_instance",
    "eventually",
    "free_port",
    "short_run_overrides",
    "start_engine",
    "start_family_server",
    "start_server",
    "step_instance",
    "stop_server",
    "wait_exit",
    "wait_healthy",
    "wait_until",
]
T = TypeVar("T")


def start_server(
    args: list[str], port: int, tmp_path: Path, env: dict[str, str] | None = None, name: str = "server"
) -> RunningServer:
    """Start ``stargym ARGS`` from the repository root, its log in ``tmp_path``; wait for /health."""
    return start_service(name, args, port, tmp_path, env=env, cwd=REPO_ROOT)


def start_engine(
    model: Path, tmp_path: Path, *extra: str, env: dict[str, str] | None = None, name: str = "engine"
) -> RunningServer:
    """``stargym engine serve`` (the CPU engine) on ``model`` at a free port; ``extra``: its flags."""
    port = free_port()
    return start_server(
        ["engine", "serve", "--model", str(model), "--port", str(port), *extra], port, tmp_path, env, name
    )


def create_instance(client: httpx.Client, env: str, seed: int, options: dict | None = None) -> dict:
    """``POST /instances`` that must succeed (201): the created instance's JSON."""
    response = client.post("/instances", json={"env": env, "seed": seed, "options": options or {}})
    assert response.status_code == 201, response.text
    return response.json()


def step_instance(client: httpx.Client, instance_id: str, action: str) -> dict:
    """``POST /instances/{id}/step`` that must succeed (200): the step's JSON."""
    response = client.post(f"/instances/{instance_id}/step", json={"action": action})
    assert response.status_code == 200, response.text
    return response.json()


def start_family_server(
    family: str, tmp_path_factory: pytest.TempPathFactory, env: dict[str, str] | None = None
) -> RunningServer:
    """``stargym env serve FAMILY`` on a free loopback port, its log in a fresh temporary folder."""
    port = free_port()
    args = ["env", "serve", family, "--port", str(port)]
    return start_server(args, port, tmp_path_factory.mktemp(family), env=env, name=family)


@pytest.fixture(scope="session")
def game_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One real game env server for the whole session (uvicorn on a free loopback port)."""
    server = start_family_server("game", tmp_path_factory)
    yield server
    stop_server(server.process)


@pytest.fixture(scope="session")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One real reasoning env server for the session, hashing strings unlike this process
    (``PYTHONHASHSEED``): questions equal to reasoning-gym's here show they do not depend on it."""
    other_hashing = str(int(os.environ.get("PYTHONHASHSEED") or 0) + 1)
    server = start_family_server("reasoning", tmp_path_factory, env={"PYTHONHASHSEED": other_hashing})
    yield server
    stop_server(server.process)


CHROMIUM = "/usr/bin/chromium"  # Debian's, driven by playwright: no browser download


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Headless Chromium for a module of browser tests (the dashboard's, the shop's). Module scope,
    not session: playwright's sync API keeps an event loop running while it is open, and every
    asyncio test after it would fail with "Runner.run() cannot be called from a running event loop"."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)"
        )
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        yield launched
        launched.close()


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


POLL = poll_client()
"""The client of the tests' polls (a status, a count, a health check inside :func:`wait_until`):
the launcher's, not ``httpx.get``'s client per call, which loads the CA bundle (~45 ms of CPU), so
a test polling every 0.1 s kept half a core busy beside the servers it waited on."""


def wait_until(
    condition: Callable[[], T],
    what: str,
    deadline_s: float = 30.0,
    interval_s: float = 0.1,
    logs: Iterable[RunningServer] = (),
) -> T:
    """Poll ``condition()`` until it returns something truthy and return that; the one way tests wait.

    After ``deadline_s`` it fails with an AssertionError that names ``what`` and shows the tail of
    each server log in ``logs``, so a hang reads as the reason it hung, not as a bare timeout.
    ``condition`` may raise AssertionError itself to end the wait early (a process that died).
    """
    deadline = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    details = "".join(f"\n--- {server.log_path.name}\n{server.log()[-4000:]}" for server in logs)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what} (last value {value!r}){details}")


def wait_exit(service: RunningServer, what: str, deadline_s: float = 8 * 60) -> None:
    """Wait for ``service`` to exit on its own (a run that ends), then require exit code 0."""
    wait_until(
        lambda: service.process.poll() is not None,
        what,
        deadline_s=deadline_s,
        interval_s=1.0,
        logs=[service],
    )
    assert service.process.returncode == 0, service.log()[-6000:]


async def eventually(
    condition: Callable[[], Awaitable[T]], what: str, deadline_s: float = 5.0, interval_s: float = 0.02
) -> T:
    """:func:`wait_until` for a coroutine condition, sleeping with ``asyncio.sleep`` between polls."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what} (last value {value!r})")
        await asyncio.sleep(interval_s)


@pytest.fixture
def empty_redis_url(redis_url: str) -> str:
    """The session's Redis, emptied first: a run that reads whole streams sees no earlier test's jobs."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return redis_url


@pytest.fixture
def db(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's Redis, emptied first."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@contextlib.contextmanager
def loopback_http_server(
    status_of: Callable[[str], int], on_post: Callable[[str, bytes], int] | None = None
) -> Iterator[str]:
    """A real HTTP server on a free loopback port answering each GET with ``status_of(path)`` and an
    empty body, and each POST with ``on_post(path, body)`` (405 without it); yields its base URL.
    For probes (health checks, waits) that only read the status, and for receivers of calls."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status_of(self.path))
            self.end_headers()

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(405 if on_post is None else on_post(self.path, body))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def short_run_overrides(tmp_path: Path, name: str) -> list[str]:
    """``--set`` overrides of a short end-to-end run of a tiny config: the run's own run dir and model
    dir under ``tmp_path``, and batches of 4 groups of 4 so that an update takes seconds."""
    return [
        f"run.name={name}",
        f"run.output_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "rollout.group_size=4",
        "rollout.groups_per_batch=4",
        "rollout.max_inflight=32",
    ]
