"""A bounded pool of ScienceWorld JVMs, shared by every SciWorld instance of a process.

ScienceWorld's simulator is Scala: each ``ScienceWorldEnv`` drives its own JVM through py4j. On
the 2-core dev machine a new JVM answered its first reset after ~1.1 s (0.8 s to start, and
2-6 s on a cold disk or with a gold path), a reused one after 29 ms (p50; 72 ms p90), and each
JVM holds ~0.5 GB (475-556 MB RSS). So JVMs are kept and lent out, at most ``pool_size`` of them:

* An instance leases a JVM for its whole life (its episode state lives in that JVM) and gives it
  back when it is closed or reaped; the next instance loads its task on the same JVM.
* :meth:`JvmPool.acquire_async` waits for a free JVM on the event loop, holding no thread, and
  :meth:`JvmPool.acquire` on the calling thread (an env used directly, without a host); both give
  up after ``acquire_timeout_s`` with a 429 ``jvm_pool_busy``, and both serve waiters first come,
  first served.
* Every call into a JVM runs under a deadline: a JVM that does not answer within
  ``call_timeout_s`` is killed, which ends the blocked py4j call; a JVM that died, was killed or
  threw is discarded and its slot freed, and :class:`~env_server.core.EnvFailure` names the
  cause. A new JVM starts lazily, on the worker thread of the next lease that finds no idle one.
* No JVM outlives its Python process: each is started with py4j's ``--die-on-broken-pipe`` (it
  exits when its stdin closes, which the kernel does when this process dies, even by SIGKILL),
  and :meth:`JvmPool.shutdown`, registered with :mod:`atexit` for the shared pool, ends them at
  once on a normal exit.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import heapq
import itertools
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from py4j.java_gateway import (
    GatewayParameters,
    JavaGateway,
    find_jar_path,
)
from py4j.protocol import Py4JError, Py4JJavaError
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from scienceworld import ScienceWorldEnv
from scienceworld.constants import BASEPATH, JAR_PATH

from env_server.core import EnvFailure
from services.errors import too_many

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A JVM whose stdin is closed exits within ~0.3 s; one that has not after this is killed.
CLOSE_GRACE_S = 5.0
STDERR_LINES = 5  # the JVM's last stderr lines kept to explain an exit (an OutOfMemoryError)


def default_pool_size(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Two JVMs per core, at most one per GiB of memory.

    An instance holds its JVM while the policy thinks, and a JVM only needs a core while it
    answers a call, so the pool outnumbers the cores; the memory bound keeps JVMs (~0.5 GB each
    at the default heap) to half of the memory, the container's limit where it has one (a
    container sees the host's memory, and a pool sized by that would be OOM-killed).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in (cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):  # absent, or "max": no limit
            memory = min(memory, int(limit_file.read_text().strip()))
    return max(1, min(2 * cores, memory // 2**30))


class JvmPoolSettings(BaseSettings):
    """The pool's limits, from ``STARGYM_SCIWORLD_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="STARGYM_SCIWORLD_", extra="ignore")

    pool_size: int = Field(
        default_factory=default_pool_size,
        gt=0,
        description="Most live JVMs, so most concurrent SciWorld instances (default: 2 per core, "
        "at most 1 per GiB of memory).",
    )
    acquire_timeout_s: float = Field(
        default=30.0, gt=0, description="How long a create waits for a free JVM before its 429."
    )
    call_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A JVM that takes longer to start or to answer one call is killed. The slowest "
        "call measured: a cold load of mendelian-genetics with its gold path, 24 s.",
    )
    heap_mb: int = Field(
        default=512,
        ge=128,
        description="Java heap per JVM. Every task's gold path replays within 256 MB (356 MB RSS); "
        "with 512 MB a JVM measured 475-556 MB RSS, and with the JVM's default (a quarter of the "
        "machine's memory) one grew past 1.3 GB.",
    )


class Watchdog:
    """One thread that runs a callback (a kill) when a guarded block outlives its deadline.

    Guarding a call costs 3 µs, where a ``threading.Timer`` per call (a thread start each) cost
    0.27 ms, 7% of a median step (4 ms).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int]] = []  # a heap of (deadline, key)
        self._expire: dict[int, Callable[[], None]] = {}  # the guards still running, by key
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, timeout_s: float, expire: Callable[[], None]) -> Iterator[None]:
        key = next(self._keys)
        with self._cond:
            heapq.heappush(self._due, (time.monotonic() + timeout_s, key))
            self._expire[key] = expire
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jvm-watchdog", daemon=True)
                self._thread.start()
            elif self._due[0][1] == key:  # the earliest deadline now: the thread sleeps too long
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._expire.pop(key, None)  # gone already if it expired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._due and (self._due[0][0] <= now or self._due[0][1] not in self._expire):
                    _, key = heapq.heappop(self._due)
                    expire = self._expire.pop(key, None)
                    if expire is not None:
                        expire()
                self._cond.wait(self._due[0][0] - now if self._due else None)


WATCHDOG = Watchdog()


class ScienceWorldJvm(ScienceWorldEnv):
    """A ``ScienceWorldEnv`` whose JVM this pool starts, watches and can kill.

    The package's constructor starts the JVM with py4j's defaults: no heap limit, the parallel
    garbage collector (a thread per core in every JVM), a callback server the simulator never
    calls, and no way to stop a start that hangs. This one sets the JVM's options and starts it
    under a deadline. The package's methods work on the attributes it sets; ``load`` and
    ``get_gold_action_sequence`` are adapted to a gateway without memory management.
    """

    def __init__(self, heap_mb: int, start_timeout_s: float) -> None:
        # -XX:+UseSerialGC: one collector thread, and (with the 512 MB heap) 20% less CPU than
        # the defaults on one workload (16 task loads, 240 steps: 20.9 s against 26.1 s).
        # -XX:+ExitOnOutOfMemoryError: a JVM out of heap exits (code 3) instead of limping on.
        command = [
            "java",
            "-classpath",
            os.pathsep.join([find_jar_path(), JAR_PATH]),
            f"-Xmx{heap_mb}m",
            "-XX:+UseSerialGC",
            "-XX:+ExitOnOutOfMemoryError",
            "py4j.GatewayServer",
            "--die-on-broken-pipe",
            "0",  # any free port; the JVM prints the one it bound
        ]
        self.kill_reason: str | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        started = time.monotonic()
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=BASEPATH
            )
        except FileNotFoundError:
            raise EnvFailure(
                "cannot start a ScienceWorld JVM: no 'java' on PATH (it needs Java 17)"
            ) from None
        self.pid = self.process.pid
        try:
            with self.deadline(start_timeout_s, "did not start within"):
                port_line = self.process.stdout.readline()
                # Both pipes are drained for the JVM's whole life: a full one would block it.
                _drain(self.process.stdout, collections.deque(maxlen=0))
                _drain(self.process.stderr, self._stderr)
                if not port_line.strip().isdigit():
                    raise EnvFailure(self.failure())
                # No memory management: py4j would tell the JVM about every Java object proxy
                # that Python garbage-collects, a blocking call made on whichever thread the
                # collector runs, the event loop's too, where a hung JVM then stalled every
                # instance for the call deadline (measured: a 5 s stall of the bandit's steps).
                # The one proxy we fetch per episode, the gold path, is detached explicitly.
                self._gateway = JavaGateway(
                    gateway_parameters=GatewayParameters(port=int(port_line), enable_memory_management=False)
                )
                self.server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        except Py4JError as error:
            raise EnvFailure(self.failure(error)) from None
        self.taskName = ""
        self.variationIdx = 0
        self.simplificationStr = ""
        self.lastStepScore = 0
        self.goldPathGenerated = False
        self.runHistories: dict = {}
        self.start_s = time.monotonic() - started

    def load(
        self,
        taskName: str,
        variationIdx: int = 0,
        simplificationStr: str = "",
        generateGoldPath: bool = False,
    ) -> None:
        """The package's ``load`` without its checks of the name and simplifications (callers
        pass checked ones), which fetch the task list as a Java object on every load."""
        self.server.load(taskName, variationIdx, simplificationStr, generateGoldPath)
        self.taskName, self.variationIdx, self.simplificationStr = taskName, variationIdx, simplificationStr
        self.lastStepScore = 0
        self.goldPathGenerated = generateGoldPath

    def get_gold_action_sequence(self) -> list[str]:
        """The package's, releasing the Java list it fetches (there is no memory management)."""
        if not self.goldPathGenerated:
            return super().get_gold_action_sequence()
        sequence = self.server.getGoldActionSequence()
        try:
            return list(sequence)
        finally:
            self._gateway.detach(sequence)

    def alive(self) -> bool:
        return self.kill_reason is None and self.process.poll() is None

    def deadline(
        self, timeout_s: float, what: str = "did not answer within"
    ) -> contextlib.AbstractContextManager[None]:
        """Kill the JVM if the block runs longer than ``timeout_s``.

        Killing the process closes its socket, so a py4j call blocked on it returns at once,
        with an error that :meth:`failure` turns into the cause.
        """
        return WATCHDOG.guard(timeout_s, lambda: self.kill(f"{what} {timeout_s:g} s; killed"))

    def kill(self, reason: str) -> None:
        if self.kill_reason is None and self.process.poll() is None:
            self.kill_reason = reason
            logger.warning("ScienceWorld JVM pid %d %s", self.pid, reason)
        self._disconnect()
        self.process.kill()

    def failure(self, error: Py4JError | None = None) -> str:
        """Why this JVM failed, for an :class:`EnvFailure`; kills it if it is still running."""
        if self.kill_reason is None:
            if isinstance(error, Py4JJavaError):  # the simulator threw: its state is unknown
                self.kill(f"failed: {' '.join(str(error).split())[:300]}; killed")
            else:
                try:
                    code = self.process.wait(timeout=2.0)  # its socket closes a moment before it exits
                except subprocess.TimeoutExpired:
                    self.kill(f"failed: {error}; killed")
                else:
                    stderr = next((line for line in reversed(self._stderr) if line), "")
                    self.kill_reason = f"exited with code {code}" + (f" ({stderr})" if stderr else "")
                    logger.warning("ScienceWorld JVM pid %d %s", self.pid, self.kill_reason)
        self._disconnect()
        return f"the ScienceWorld JVM (pid {self.pid}) {self.kill_reason}"

    def close(self) -> None:
        """End the JVM: hung up on, it exits within ~0.3 s; killed if it lingers."""
        process: subprocess.Popen | None = getattr(self, "process", None)
        if process is None:  # the constructor failed before the start
            return
        self.hang_up()
        if process.poll() is None:
            try:
                process.wait(timeout=CLOSE_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._disconnect()

    def hang_up(self) -> None:
        """Close our connections and the JVM's stdin, which ends it (py4j's --die-on-broken-pipe)."""
        gateway = getattr(self, "_gateway", None)
        if gateway is not None:
            gateway.close()
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def _disconnect(self) -> None:
        """Make py4j calls to a gone JVM fail at once: each would otherwise try to connect (a
        call cut off by a kill is retried once) and log a traceback."""
        gateway = getattr(self, "_gateway", None)
        if gateway is not None:
            gateway._gateway_client.is_connected = False


@dataclass(eq=False)
class _Waiter:
    """A queued acquire: ``wake`` is called once a JVM (or a slot for a new one) is handed over."""

    wake: Callable[[], None]
    granted: bool = False
    jvm: ScienceWorldJvm | None = None


@dataclass(eq=False)
class Lease:
    """One instance's hold on a pool slot and, once started, the JVM in it."""

    pool: JvmPool
    jvm: ScienceWorldJvm | None = None
    released: bool = field(default=False, init=False)

    def run(self, call: Callable[[ScienceWorldJvm], T], *, fresh: bool = False) -> T:
        """Run ``call`` on the leased JVM under the call deadline; blocking, for a worker thread.

        ``fresh``: the call starts a new episode, so a JVM that died since the last one is
        replaced silently (and one is started if the slot has none); mid-episode, a dead JVM is
        an :class:`EnvFailure`, as is any py4j error (the JVM is then discarded).
        """
        if fresh and (self.jvm is None or not self.jvm.alive()):
            self.jvm = self.pool.start_jvm(replacing=self.jvm)
        jvm = self.jvm
        if jvm is None or not jvm.alive():
            raise EnvFailure(jvm.failure() if jvm is not None else "no ScienceWorld JVM: reset first")
        try:
            with jvm.deadline(self.pool.settings.call_timeout_s):
                result = call(jvm)
        except Py4JError as error:
            raise EnvFailure(jvm.failure(error)) from None
        if jvm.kill_reason is not None:  # the deadline struck as the answer came
            raise EnvFailure(jvm.failure())
        return result

    def release(self) -> None:
        """Give the slot back (idempotent): a live JVM goes to the next waiter or the idle list."""
        if not self.released:
            self.released = True
            self.pool.release(self.jvm)


class JvmPool:
    """At most ``settings.pool_size`` JVMs: idle ones, and ones leased to instances.

    All bookkeeping happens under one thread lock, as leases are taken on the event loop and on
    worker threads and given back on worker threads. A slot freed while others wait is handed
    straight to the longest waiter, so a newcomer cannot take it first.
    """

    def __init__(self, settings: JvmPoolSettings | None = None) -> None:
        self.settings = settings or JvmPoolSettings()
        self._lock = threading.Lock()
        self._idle: list[ScienceWorldJvm] = []
        self._leased = 0  # slots lent out, with or without a started JVM
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._live: set[ScienceWorldJvm] = set()  # every started, not yet closed JVM
        self._shut = False

    @property
    def live_jvms(self) -> int:
        return len(self._live)

    @property
    def idle_jvms(self) -> int:
        return len(self._idle)

    def pids(self) -> set[int]:
        with self._lock:
            return {jvm.pid for jvm in self._live}

    def acquire(self, timeout_s: float | None = None) -> Lease:
        """A lease, waiting on this thread up to ``timeout_s`` (default: the settings')."""
        event = threading.Event()
        with self._lock:
            lease = self._take()
            if lease is not None:
                return lease
            waiter = _Waiter(event.set)
            self._waiters.append(waiter)
        timeout_s = self.settings.acquire_timeout_s if timeout_s is None else timeout_s
        event.wait(timeout_s)
        return self._settle(waiter, timeout_s)

    async def acquire_async(self, timeout_s: float | None = None) -> Lease:
        """A lease, waiting on the event loop (no thread held) up to ``timeout_s``."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        with self._lock:
            lease = self._take()
            if lease is not None:
                return lease
            waiter = _Waiter(lambda: loop.call_soon_threadsafe(_resolve, woken))
            self._waiters.append(waiter)
        timeout_s = self.settings.acquire_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await woken
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if waiter.granted:
                self.release(waiter.jvm)
            raise
        return self._settle(waiter, timeout_s)

    def release(self, jvm: ScienceWorldJvm | None) -> None:
        """Return a slot; its JVM, if alive, to the longest waiter or the idle list."""
        if jvm is not None and not jvm.alive():
            self._discard(jvm)
            jvm = None
        with self._lock:
            if self._shut:
                self._leased -= 1
            elif self._waiters:
                waiter = self._waiters.popleft()
                waiter.granted, waiter.jvm = True, jvm
                waiter.wake()
                return
            else:
                self._leased -= 1
                if jvm is not None:
                    self._idle.append(jvm)
                    return
        if jvm is not None:  # shut down meanwhile
            self._discard(jvm)

    def start_jvm(self, replacing: ScienceWorldJvm | None = None) -> ScienceWorldJvm:
        """Start a JVM for a lease whose slot has none (or a dead one, ``replacing``)."""
        if replacing is not None:
            self._discard(replacing)
        if self._shut:
            raise EnvFailure("the ScienceWorld JVM pool is shut down (the server is stopping)")
        jvm = ScienceWorldJvm(self.settings.heap_mb, self.settings.call_timeout_s)
        with self._lock:
            self._live.add(jvm)
            live = len(self._live)
        logger.info(
            "started ScienceWorld JVM pid %d in %.1f s (%d of %d live)",
            jvm.pid,
            jvm.start_s,
            live,
            self.settings.pool_size,
        )
        return jvm

    def shutdown(self) -> None:
        """End every JVM, idle or leased; later releases close theirs instead of keeping them."""
        with self._lock:
            self._shut = True
            jvms = list(self._live)
            self._idle.clear()
        for jvm in jvms:  # all at once: each takes ~0.3 s to exit
            jvm.hang_up()
        for jvm in jvms:
            self._discard(jvm)

    def _take(self) -> Lease | None:
        """A lease if one is free now (lock held): an idle JVM, else a free slot, else None."""
        if self._shut:
            raise RuntimeError("the ScienceWorld JVM pool is shut down")
        while self._idle:
            jvm = self._idle.pop()
            if jvm.alive():
                self._leased += 1
                return Lease(self, jvm)
            self._live.discard(jvm)
            jvm.failure()  # logs why it died while idle
            jvm.close()  # quick: its process is gone
        if len(self._idle) + self._leased < self.settings.pool_size and not self._waiters:
            self._leased += 1
            return Lease(self)
        return None

    def _settle(self, waiter: _Waiter, timeout_s: float) -> Lease:
        """After a wait: the lease handed over, or (deadline passed) a 429."""
        with self._lock:
            if not waiter.granted:
                self._waiters.remove(waiter)
                size = self.settings.pool_size
                raise too_many(
                    "jvm_pool_busy",
                    f"all {size} ScienceWorld JVMs are in use and none came free within {timeout_s:g} s "
                    "(STARGYM_SCIWORLD_POOL_SIZE sets how many there are)",
                )
        return Lease(self, waiter.jvm)

    def _discard(self, jvm: ScienceWorldJvm) -> None:
        with self._lock:
            self._live.discard(jvm)
        jvm.close()


def _drain(pipe: IO[bytes], keep: collections.deque[str]) -> None:
    """Read ``pipe`` to its end on a daemon thread, keeping the last lines in ``keep``, then close it."""

    def read() -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                keep.append(line.decode(errors="replace").strip())

    threading.Thread(target=read, name="jvm-output", daemon=True).start()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_shared: JvmPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> JvmPool:
    """The process's pool, configured from the environment on first use and shut down at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = JvmPool()
            atexit.register(_shared.shutdown)
        return _shared


def shutdown_shared_pool() -> None:
    """End the shared pool's JVMs now, if it was ever used; a later use starts a new pool.

    For a host that stops: uvicorn ends its process by re-raising SIGTERM, so atexit hooks do
    not run there.
    """
    global _shared
    with _shared_lock:
        pool, _shared = _shared, None
    if pool is not None:
        pool.shutdown()
