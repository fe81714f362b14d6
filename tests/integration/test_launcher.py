"""``deploy.launcher``: real services started below this process's CPU priority, and on ports
that another service takes first.

``stargym up`` runs the env servers, the engine and the rollout worker ``nice``-d below the trainer
(``deploy.up.ROLLOUT_NICENESS``), lowered once they are healthy (a niced start can starve on a
busy machine); the priority must hold for every thread and child process of the service, and for
those it makes later, not only for the one that started it, or the engine's torch threads would
compete at full weight.

``stargym up`` starts the services that do not depend on one another at the same time; a start
that fails must not leave the others' processes behind.

Two stacks on one machine (the test suite runs two) choose free ports at once, and a port can be
taken between being chosen and being bound. The taken port is forced here (the race itself cannot
be timed): the port is held by a real env server, and the launcher must see that the /health
answer is not its own service's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy.launcher import (
    PortTakenError,
    ServiceProcess,
    concurrent_starts,
    free_port,
    lower_priority,
    start_on_free_port,
    start_service,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(120)


def _commands() -> list[str]:
    """The command line of every process (Linux); one that exits while being read is skipped."""
    commands = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            commands.append(
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:  # gone between the listing and the read
            continue
    return commands


def thread_priorities(pid: int) -> set[int]:
    """The nice value of every thread of ``pid`` (Linux: each thread has its own)."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("niceness", [0, 3])
def test_a_service_and_all_its_threads_run_niceness_steps_below_the_launcher(
    tmp_path: Path, niceness: int
) -> None:
    port = free_port()
    service = start_service(
        "env-game", ["env", "serve", "game", "--port", str(port)], port, tmp_path, niceness=niceness
    )
    try:
        assert len(os.listdir(f"/proc/{service.process.pid}/task")) > 1  # threads made after the start
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert thread_priorities(service.process.pid) == {min(19, own + niceness)}
    finally:
        service.stop()


# A process with a thread and a child process (which has a thread of its own); on a line from stdin
# it makes a new thread and a new child and prints the nice value of each.
TREE = """
import os, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import threading, time; "
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); print(flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(child.pid, flush=True)
sys.stdin.readline()
seen = []
thread = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
thread.start(); thread.join()
late = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
    capture_output=True, text=True, check=True)
print(seen[0], late.stdout.strip(), flush=True)
child.kill()
"""


def test_lowering_a_started_process_lowers_its_threads_its_children_and_what_they_make_later() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child: int | None = None
    try:
        child = int(parent.stdout.readline())
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert thread_priorities(parent.pid) == thread_priorities(child) == {own}
        lower_priority(parent.pid, 3)
        assert thread_priorities(parent.pid) == thread_priorities(child) == {min(19, own + 3)}
        parent.stdin.write("\n")
        parent.stdin.flush()
        later_thread, later_child = map(int, parent.stdout.readline().split())
        assert later_thread == later_child == min(19, own + 3)
        assert parent.wait(timeout=30) == 0
    finally:
        parent.kill()
        if child is not None:  # the parent's kill leaves its child behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_service_whose_port_another_holds_fails_fast_as_port_taken(tmp_path: Path) -> None:
    port = free_port()
    holder = start_service("env-game", ["env", "serve", "game", "--port", str(port)], port, tmp_path)
    try:
        assert httpx.get(f"{holder.url}/health").json()["launch_id"]  # echoed by /health
        started = time.monotonic()
        with pytest.raises(PortTakenError, match="taken"):
            start_service("env-late", ["env", "serve", "game", "--port", str(port)], port, tmp_path)
        assert time.monotonic() - started < 30  # not the 60 s health deadline, nor a silent success
        assert holder.process.poll() is None  # the holder is left alone
    finally:
        holder.stop()
    # the late service was stopped, not left running
    assert not [command for command in _commands() if f"--port {port}" in command]


@pytest.mark.parametrize(
    ("health", "ours"),
    [
        ({"service": "env server (game)", "version": "0.1.0"}, True),  # from before the field
        ({"service": "env server (game)", "version": "0.1.0", "launch_id": None}, False),  # not ours
    ],
    ids=["no-launch-id-field", "another-launch"],
)
def test_a_server_that_echoes_no_launch_id_is_taken_on_trust(
    tmp_path: Path, health: dict, ours: bool
) -> None:
    """``bench/learning.py`` runs an older checkout as an arm: its servers answer /health without
    the field, and must not be taken for another launch's."""
    (tmp_path / "health").write_text(json.dumps(health))
    port = free_port()
    serve_files = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    server = subprocess.Popen([*serve_files, "--directory", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        if ours:
            wait_healthy(url, server, deadline_s=30, launch_id="this-launch")
        else:
            with pytest.raises(PortTakenError, match="launch id None"):
                wait_healthy(url, server, deadline_s=30, launch_id="this-launch")
    finally:
        server.kill()
        server.wait()


def test_start_on_free_port_chooses_again_when_its_port_is_taken(tmp_path: Path) -> None:
    taken = free_port()
    holder = start_service("env-game", ["env", "serve", "game", "--port", str(taken)], taken, tmp_path)
    chosen: list[int] = []

    def choose() -> int:
        chosen.append(taken if not chosen else free_port())
        return chosen[-1]

    try:
        service = start_on_free_port(
            "env-game", lambda port: ["env", "serve", "game", "--port", str(port)], choose, tmp_path
        )
        try:
            assert chosen[0] == taken and service.url == f"http://127.0.0.1:{chosen[-1]}" != holder.url
            assert (
                httpx.get(f"{service.url}/health").json()["launch_id"]
                != httpx.get(f"{holder.url}/health").json()["launch_id"]
            )
        finally:
            service.stop()
    finally:
        holder.stop()


def _game_server_args(port: int) -> list[str]:
    return ["env", "serve", "game", "--port", str(port)]


def test_services_started_together_all_answer_and_a_failed_start_leaves_the_rest_to_stop(
    tmp_path: Path,
) -> None:
    started: list[ServiceProcess] = []
    try:
        with concurrent_starts(started) as start:
            first = start("env-a", _game_server_args, free_port, tmp_path)
            second = start("env-b", _game_server_args, free_port, tmp_path)
            a, b = first.result(), second.result()
        assert {a.name, b.name} == {"env-a", "env-b"} and a.url != b.url
        assert sorted(service.name for service in started) == ["env-a", "env-b"]
        assert all(httpx.get(f"{service.url}/health").status_code == 200 for service in started)
    finally:
        for service in started:
            service.stop()

    started = []
    with pytest.raises(RuntimeError, match="env-bad failed to start"), concurrent_starts(started) as start:
        good = start("env-good", _game_server_args, free_port, tmp_path)
        start(
            "env-bad",
            lambda port: ["env", "serve", "no-such-family", "--port", str(port)],
            free_port,
            tmp_path,
        ).result()
    try:
        # the body raised at once; leaving the block waited for the other start, which is kept to stop
        assert good.done() and [service.name for service in started] == ["env-good"]
        assert good.result().process.poll() is None
    finally:
        for service in started:
            service.stop()
