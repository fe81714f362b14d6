"""Env instances in processes of their own, so a step that hangs or spins can be stopped.

An env the server cannot vouch for (``Env.trusted`` is False: every env a user adds, until its
author declares it) may loop forever in pure Python or block in C, and no thread can be
interrupted from outside. So each instance of such an env lives in a child process, forked from a
zygote (:mod:`env_server.sandbox_worker`) that imported and prepared the env classes once; every
call into it has a deadline, ``step_timeout_s``, past which the child is SIGKILLed and the
instance ends with :class:`EnvFailure` naming the timeout. Other instances, in other processes,
step on as before. Calls are length-prefixed JSON over a Unix socket (bench/sandbox.py measures
what a step costs this way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel

from env_server.core import Env, EnvFailure, Observation, Step
from env_server.pool import HostOptions
from env_server.registry import USER_MODULE_PREFIX
from env_server.sandbox_worker import FRAME_HEADER, frame, loads_json

log = logging.getLogger(__name__)

# A fork of the zygote is a few milliseconds; this much leaves room for a loaded machine and an
# env whose constructor or ``start`` is slow, and still ends a create that would never finish.
START_TIMEOUT_S = 120.0  # the zygote imports every sandboxed env class and prepares it
EXIT_REPORT_WAIT_S = 1.0  # how long to wait for the zygote to say how a dead child ended
_EXITS_KEPT = 4096

_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]


def sandboxed_ids(env_classes: dict[str, type[Env]], isolate: Literal["untrusted", "all"]) -> list[str]:
    """The env ids whose instances get a process each: the untrusted ones, or all of them."""
    chosen = [env_id for env_id, cls in env_classes.items() if isolate == "all" or not cls.trusted]
    for env_id in chosen:
        cls = env_classes[env_id]
        if cls.agentgym_dialect == "webshop" or cls.routers():
            raise TypeError(
                f"{env_id} serves pages from its env object (routers() or the webshop dialect), which "
                "must live in the server's process: declare it `trusted = True`"
            )
    return sorted(chosen)


def locator(env_class: type[Env]) -> str:
    """Where the zygote finds ``env_class``: ``module:Class``, or ``file.py:Class`` for an env
    loaded from a file (its module has no importable name)."""
    module = sys.modules[env_class.__module__]
    where = module.__file__ if env_class.__module__.startswith(USER_MODULE_PREFIX) else module.__name__
    return f"{where}:{env_class.__name__}"


class SandboxHost:
    """The zygote process and the Unix socket its children connect back to."""

    def __init__(self, env_classes: dict[str, type[Env]], step_timeout_s: float) -> None:
        self.env_classes = env_classes
        self.step_timeout_s = step_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="stargym-sandbox-"))
        self._socket_path = str(self._dir / "instances.sock")
        self._zygote: asyncio.subprocess.Process | None = None
        self._server: asyncio.AbstractServer | None = None
        self._reports: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._connected: dict[str, asyncio.Future[_Connection]] = {}
        self._stopping = False
        self._pids: dict[str, int] = {}
        self._exits: OrderedDict[int, str] = OrderedDict()

    async def start(self) -> None:
        """Start the zygote and wait until it has imported and prepared every class."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._server = await asyncio.start_unix_server(self._on_connect, self._socket_path)
        self._zygote = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "env_server.sandbox_worker",
            self._socket_path,
            *(locator(cls) for cls in self.env_classes.values()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self._reports = asyncio.create_task(self._read_reports())
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except TimeoutError:
            await self.stop()
            raise EnvFailure(f"the sandbox did not start within {START_TIMEOUT_S:g} s") from None
        except EnvFailure:
            await self.stop()
            raise

    async def spawn(self, env_id: str) -> SandboxedEnv:
        """A new process holding a new instance of ``env_id`` (constructed and started)."""
        if self._zygote is None or self._zygote.returncode is not None:
            raise EnvFailure("the sandbox's zygote is not running")
        token = secrets.token_hex(8)
        connected = asyncio.get_running_loop().create_future()
        self._connected[token] = connected
        assert self._zygote.stdin is not None
        self._zygote.stdin.write(orjson.dumps({"env": env_id, "token": token}) + b"\n")
        try:
            reader, writer, hello = await asyncio.wait_for(connected, self.step_timeout_s)
        except TimeoutError:
            self.kill(token)
            self.forget(token)
            raise EnvFailure(
                f"a new instance did not start within step_timeout_s={self.step_timeout_s:g} s; "
                "its process was killed"
            ) from None
        finally:
            self._connected.pop(token, None)
        if "failure" in hello:
            writer.close()
            self.forget(token)
            raise EnvFailure(f"the env could not be built: {hello['failure']}")
        return SandboxedEnv(self, token, reader, writer)

    async def exit_of(self, token: str) -> str:
        """How the process of ``token`` ended, as the zygote reports it (shortly after the end)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXIT_REPORT_WAIT_S
        while (pid := self._pids.get(token)) is None or pid not in self._exits:
            if loop.time() > deadline:
                return "no exit status was reported"
            await asyncio.sleep(0.01)
        return self._exits[pid]

    def pid_of(self, token: str) -> int | None:
        return self._pids.get(token)

    def forget(self, token: str) -> None:
        self._pids.pop(token, None)

    def kill(self, token: str) -> None:
        pid = self._pids.get(token)
        if pid is None or pid in self._exits:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def stop(self) -> None:
        """End the zygote; its children die with it (``PR_SET_PDEATHSIG``)."""
        self._stopping = True
        if self._zygote is not None and self._zygote.returncode is None:
            assert self._zygote.stdin is not None
            self._zygote.stdin.close()
            try:
                await asyncio.wait_for(self._zygote.wait(), 5.0)
            except TimeoutError:
                self._zygote.kill()
                await self._zygote.wait()
        if self._reports is not None:
            self._reports.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reports
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await _read(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        waiter = self._connected.get(hello.get("token", ""))
        if waiter is None or waiter.done():  # its create gave up waiting: the child exits on EOF
            writer.close()
            return
        waiter.set_result((reader, writer, hello))

    async def _read_reports(self) -> None:
        assert self._zygote is not None and self._zygote.stdout is not None and self._ready is not None
        async for line in self._zygote.stdout:
            report = orjson.loads(line)
            if "forked" in report:
                self._pids[report["token"]] = report["forked"]
                self._exits.pop(report["forked"], None)  # a pid used before, long ago
            elif "exited" in report:
                self._exits[report["exited"]] = report["how"]
                while len(self._exits) > _EXITS_KEPT:
                    self._exits.popitem(last=False)
            elif "ready" in report:
                self._ready.set_result(None)
            elif "error" in report and not self._ready.done():
                self._ready.set_exception(
                    EnvFailure(f"the sandbox could not load its envs: {report['error']}")
                )
        if not self._ready.done():
            self._ready.set_exception(EnvFailure("the sandbox's zygote exited before it was ready"))
        elif not self._stopping:
            log.error("the sandbox's zygote exited; new sandboxed instances cannot start")


class SandboxedEnv:
    """One instance in its own process; the methods :class:`env_server.pool.LocalEnv` has."""

    inline = False
    env = None  # the env object lives in the child

    def __init__(
        self, host: SandboxHost, token: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._host = host
        self._token = token
        self._reader = reader
        self._writer = writer
        self._actions: list[str] | None = None
        self._ended: str | None = None  # why this instance can take no more calls

    async def reset(self, seed: int, options: BaseModel, host_options: HostOptions) -> Observation:
        answer = await self._call(
            {
                "op": "reset",
                "seed": seed,
                "options": options.model_dump(mode="json"),
                "host": host_options.model_dump(),
            },
            "reset",
        )
        return Observation(answer["observation"], answer["info"])

    async def play(self, reply: str, host_options: HostOptions) -> Step:
        """One reply; ``host_options`` went to the child with the reset that set them."""
        answer = await self._call({"op": "play", "reply": reply}, "step")
        return Step(answer["observation"], answer["reward"], answer["done"], answer["info"])

    @property
    def pid(self) -> int | None:
        """Its process's id, once the zygote has reported it."""
        return self._host.pid_of(self._token)

    def available_actions(self) -> list[str] | None:
        """As of the last reset or step: the child sends them with every answer."""
        return self._actions

    async def close(self) -> None:
        if self._ended is None:
            self._ended = "the instance is closed"
            try:
                await asyncio.wait_for(self._send_and_read({"op": "close"}), self._host.step_timeout_s)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                self._host.kill(self._token)
        self._writer.close()
        self._host.forget(self._token)

    async def _call(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        if self._ended is not None:
            raise EnvFailure(self._ended)
        timeout = self._host.step_timeout_s
        try:
            answer = await asyncio.wait_for(self._send_and_read(message), timeout)
        except TimeoutError:
            self._host.kill(self._token)
            self._ended = (
                f"its {what} did not return within step_timeout_s={timeout:g} s; its process was killed"
            )
            raise EnvFailure(self._ended) from None
        except (asyncio.IncompleteReadError, ConnectionError):
            self._ended = f"its process died during a {what} ({await self._host.exit_of(self._token)})"
            raise EnvFailure(self._ended) from None
        if "failure" in answer:
            raise EnvFailure(answer["failure"])
        self._actions = answer.pop("actions")
        return answer

    async def _send_and_read(self, message: dict[str, Any]) -> dict[str, Any]:
        self._writer.write(frame(message))
        return await _read(self._reader)


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    header = await reader.readexactly(FRAME_HEADER.size)
    return loads_json(await reader.readexactly(FRAME_HEADER.unpack(header)[0]))
