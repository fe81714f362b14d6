"""Runs stargym services as local processes: the no-Docker way to bring the system up.

The same services the containers run, started as subprocesses of this Python, each with its
log in a file, each waited for on ``/health`` with a deadline before anything depends on it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARGYM = [sys.executable, "-m", "deploy"]


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServiceProcess:
    """A started service: where it answers, its process, and its log file."""

    name: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.process, timeout_s)


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_healthy(url: str, process: subprocess.Popen, deadline_s: float = 60.0) -> None:
    """Poll ``url/health`` until it answers 200; fail at once if the process died."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} was not healthy after {deadline_s:.0f} s")


def start_service(
    name: str,
    args: list[str],
    port: int,
    log_dir: Path,
    env: dict[str, str] | None = None,
    health_deadline_s: float = 60.0,
    cwd: Path | None = None,
    niceness: int = 0,
) -> ServiceProcess:
    """Start ``stargym ARGS`` (which must listen on ``port``) and return once it is healthy.

    ``niceness``: how many steps below this process's CPU priority the service runs, through
    POSIX ``nice`` (it execs the service, so the pid is the service's and every thread the service
    makes inherits the priority; ``preexec_fn`` would do the same but is unsafe in a threaded parent).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*(["nice", "-n", str(niceness)] if niceness else []), *STARGYM, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
    service = ServiceProcess(name, f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(service.url, process, health_deadline_s)
    except (RuntimeError, TimeoutError) as exc:
        service.stop()
        raise RuntimeError(f"{name} failed to start: {exc}\n--- log ---\n{service.log()}") from None
    return service
