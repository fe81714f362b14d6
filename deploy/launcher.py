"""Runs stargym services as local processes: the no-Docker way to bring the system up.

The same services the containers run, started as subprocesses of this Python, each with its
log in a file, each waited for on ``/health`` with a deadline before anything depends on it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

STARGYM = [sys.executable, "-m", "deploy"]

logger = logging.getLogger(__name__)


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


class PortTakenError(RuntimeError):
    """Another process holds the port a service was started on: it was free when chosen and
    taken before the service bound it (two stacks on one machine choose ports at once)."""


def wait_healthy(
    url: str, process: subprocess.Popen, deadline_s: float = 60.0, launch_id: str | None = None
) -> None:
    """Poll ``url/health`` until it answers 200; fail at once if the process died.

    ``launch_id``: the ``STARGYM_LAUNCH_ID`` the service was started with. A stargym service that
    answers with another one is not this process but whoever took its port first: without this
    check a stack went on with another test's rollout worker in its place, and its trainer waited
    eight minutes for trajectories. (Servers that echo none, such as vLLM or a stargym release from
    before the field, are taken on trust: ``bench/learning.py`` runs an older checkout as an arm.)
    """
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode} before it was healthy")
        try:
            answer = poll_client().get(f"{url}/health", timeout=1.0)
        except httpx.TransportError:
            answer = None
        if answer is not None and answer.status_code == 200:
            if launch_id is not None:
                _check_launch_id(url, answer, launch_id)
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} was not healthy after {deadline_s:.0f} s")


@functools.cache
def poll_client() -> httpx.Client:
    """The client of every poll of a service: its health while it starts, a trainer's status.

    ``httpx.get`` builds a client per call, whose TLS context loads the CA bundle: ~45 ms of CPU
    a call, so polling every 50 ms kept half a core busy while the services, on the same cores,
    were starting (``bench/startup.py``: every service healthy after 17.1 s, 13.6 s with this).
    One client for the process, shared by the threads of :func:`concurrent_starts`; it keeps no
    connection, as a polled service may be killed and another process take its port."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def _check_launch_id(url: str, answer: httpx.Response, launch_id: str) -> None:
    """Raise :class:`PortTakenError` when a stargym service other than the one launched answers."""
    try:
        body = answer.json()
    except ValueError:
        return
    # a body without the field echoes none: taken as ours
    if isinstance(body, dict) and "service" in body and body.get("launch_id", launch_id) != launch_id:
        raise PortTakenError(
            f"{url} is answered by another {body['service']} service (launch id {body.get('launch_id')}), "
            "not the one just started: the port was taken between choosing and binding it"
        )


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

    ``niceness``: how many steps below this process's CPU priority the service runs once it is
    healthy (:func:`lower_priority`). It starts at this process's priority: started niced, an
    engine on a machine busy with a container build and another stack got so little CPU that it
    had printed nothing after 60 s, its imports alone unfinished (two e2e tests failed so). The
    niceness is for the steady state, where the trainer must win the CPU from the rollout side.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    launch_id = uuid.uuid4().hex
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*STARGYM, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "STARGYM_LAUNCH_ID": launch_id},
            cwd=cwd,
        )
    service = ServiceProcess(name, f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(service.url, process, health_deadline_s, launch_id=launch_id)
    except (RuntimeError, TimeoutError) as exc:
        service.stop()
        log = service.log()
        # uvicorn's words when its bind fails: the service lost the race before anyone answered.
        taken = isinstance(exc, PortTakenError) or "address already in use" in log
        error = PortTakenError if taken else RuntimeError
        raise error(f"{name} failed to start: {exc}\n--- log ---\n{log}") from None
    if niceness:
        lower_priority(process.pid, niceness)
    return service


def lower_priority(pid: int, steps: int) -> None:
    """Run ``pid``, every thread of it and every process it started ``steps`` nice steps below this
    process (at most 19).

    Linux keeps a nice value per thread (``setpriority`` on a pid changes its main thread only),
    and a new thread or process takes its creator's, so once every thread there is lowered, all
    that they make later is too. A thread made while the threads are being listed can miss a pass,
    so passes repeat until one finds nothing left to lower. Without ``/proc`` (macOS),
    ``setpriority`` on the pid sets the whole process.
    """
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + steps)
    if not os.path.isdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, pid, target)
        return
    while _lower_tree(pid, target):
        pass


def _lower_tree(pid: int, target: int) -> int:
    """One pass of :func:`lower_priority` over ``pid`` and its descendants: how many threads it lowered."""
    lowered = 0
    pending = [pid]
    while pending:
        process = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{process}/task")
        except FileNotFoundError:  # exited since it was listed
            continue
        for task in map(int, tasks):
            try:
                if os.getpriority(os.PRIO_PROCESS, task) < target:
                    os.setpriority(os.PRIO_PROCESS, task, target)
                    lowered += 1
                children = Path(f"/proc/{process}/task/{task}/children").read_text().split()
            except (ProcessLookupError, FileNotFoundError):  # the thread exited meanwhile
                continue
            pending.extend(map(int, children))
    return lowered


def start_on_free_port(
    name: str,
    args_for_port: Callable[[int], list[str]],
    choose_port: Callable[[], int],
    log_dir: Path,
    attempts: int = 3,
    **options: Any,
) -> ServiceProcess:
    """:func:`start_service` on ``choose_port()``, choosing again when the port is taken before the
    service binds it (:class:`PortTakenError`), at most ``attempts`` times; ``options`` go to
    :func:`start_service`."""
    for _ in range(attempts - 1):
        port = choose_port()
        try:
            return start_service(name, args_for_port(port), port, log_dir, **options)
        except PortTakenError as exc:
            logger.warning("%s: port %d was taken before it could bind it; choosing another", name, port)
            logger.debug("%s", exc)
    port = choose_port()
    return start_service(name, args_for_port(port), port, log_dir, **options)


@contextlib.contextmanager
def concurrent_starts(started: list[ServiceProcess]) -> Iterator[Callable[..., Future[ServiceProcess]]]:
    """A ``start`` function that runs :func:`start_on_free_port` on a thread and returns its future,
    so services that do not depend on one another start at the same time.

    A service spends its first seconds importing (torch, transformers) and loading, 8.6 s for the
    CPU engine on 2 cores; started one after another, a stack waits for the sum of those
    (``bench/startup.py``). Each service is appended to ``started`` once it is healthy, whether or
    not another start failed, so the caller's cleanup stops it; leaving the block waits for every
    start still in flight, so a failed start leaves no process behind.
    """
    with ThreadPoolExecutor(thread_name_prefix="start") as pool:

        def keep(done: Future[ServiceProcess]) -> None:
            if done.exception() is None:
                started.append(done.result())

        def start(name: str, *args: Any, **options: Any) -> Future[ServiceProcess]:
            future = pool.submit(start_on_free_port, name, *args, **options)
            future.add_done_callback(keep)
            return future

        yield start
