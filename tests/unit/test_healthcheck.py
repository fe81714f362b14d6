"""``python -m deploy.healthcheck URL``, the containers' health check, against a real HTTP server.

Its exit status is all docker and podman look at (0 healthy, anything else not), and its stderr is
what `docker inspect` shows as the reason, so both are checked, in-process and as the command the
compose file runs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import loopback_http_server

from deploy import healthcheck

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """A loopback server: ``/health`` answers 200, ``/down`` 503."""
    with loopback_http_server(lambda path: 200 if path == "/health" else 503) as url:
        yield url


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    """The health check as a container runs it."""
    return subprocess.run(
        [sys.executable, "-m", "deploy.healthcheck", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_200_is_healthy(server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert healthcheck.main([f"{server_url}/health"]) == 0
    assert capsys.readouterr().err == ""
    done = run_module(f"{server_url}/health")
    assert (done.returncode, done.stderr) == (0, "")


def test_an_error_status_is_unhealthy_and_named(server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert healthcheck.main([f"{server_url}/down"]) == 1
    assert capsys.readouterr().err == f"{server_url}/down: HTTP 503\n"
    done = run_module(f"{server_url}/down")
    assert done.returncode == 1 and "HTTP 503" in done.stderr


def test_a_refused_connection_is_unhealthy(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert healthcheck.main([f"http://127.0.0.1:{port}/health"]) == 1
    assert "refused" in capsys.readouterr().err.lower()


def test_a_server_that_never_answers_is_unhealthy_after_the_timeout() -> None:
    with socket.socket() as sock:  # accepts connections (the backlog) and never answers
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        started = time.monotonic()
        problem = healthcheck.check(f"http://127.0.0.1:{sock.getsockname()[1]}/health", timeout_s=0.2)
    assert problem is not None and "timed out" in problem
    assert time.monotonic() - started < 5


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert healthcheck.main([]) == 2
    assert healthcheck.main(["http://a/health", "http://b/health"]) == 2
    assert capsys.readouterr().err.count("usage: python -m deploy.healthcheck URL") == 2
    done = run_module()
    assert done.returncode == 2 and "usage" in done.stderr


def test_it_imports_only_the_standard_library() -> None:
    """A probe every few seconds per container: importing torch or the CLI would cost ~1 s each."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; before = set(sys.modules); import deploy.healthcheck; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "['deploy']"
