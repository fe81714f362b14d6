"""The far side of :mod:`env_server.sandbox`: a zygote that forks one process per env instance.

``python -m env_server.sandbox_worker SOCKET LOCATOR...`` imports the env classes the server
runs sandboxed, prepares them (a corpus loaded here is shared copy-on-write by every child),
freezes its heap, answers ``{"ready": [...]}`` on stdout and then reads spawn requests, one JSON
line each, on stdin. Each request forks a child that connects back to the server's Unix socket
and serves one instance until it is told to close, its server goes away, or it is killed.

The zygote is single-threaded, which is what makes ``fork`` safe here and not in the server (its
worker threads may hold locks a child would inherit held). It reports how each child ended
(``{"exited": pid, "how": ...}``) so the server can say why an instance's process died.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import random
import signal
import socket
import struct
import sys
import traceback
from typing import Any

import orjson

from env_server.core import Env, EnvFailure, Observation, Step
from env_server.pool import HostOptions, play_turn
from env_server.registry import load_env_path
from services.http_app import dumps_json

FRAME_HEADER = struct.Struct(">I")  # each message: its length, then that many bytes of JSON
_PR_SET_PDEATHSIG = 1


def read_frame(conn: socket.socket) -> Any | None:
    """The next message, or None when the server closed the connection."""
    header = _read_exactly(conn, FRAME_HEADER.size)
    if header is None:
        return None
    body = _read_exactly(conn, FRAME_HEADER.unpack(header)[0])
    return None if body is None else loads_json(body)


def frame(message: Any) -> bytes:
    body = dumps_json(message)
    return FRAME_HEADER.pack(len(body)) + body


def loads_json(body: bytes) -> Any:
    """orjson, or the stdlib for what orjson refuses to read: a lone surrogate's escape, which
    :func:`services.http_app.dumps_json` writes for an env that echoes one."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        import json

        return json.loads(body)


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = conn.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def serve_instance(conn: socket.socket, token: str, env_class: type[Env]) -> None:
    """Build one env, say hello (or why it could not be built), then answer the server's calls
    on it until ``close`` or the connection ends."""
    hello: dict[str, Any] = {"token": token, "pid": os.getpid()}
    try:
        env = env_class()
        asyncio.run(env.start())
    except Exception as exc:
        traceback.print_exc()
        conn.sendall(frame({**hello, "failure": f"{type(exc).__name__}: {exc}"}))
        return
    conn.sendall(frame(hello))
    host_options = HostOptions()
    try:
        while (message := read_frame(conn)) is not None:
            op = message["op"]
            if op == "close":
                break
            try:
                if op == "reset":
                    host_options = HostOptions.model_validate(message["host"])
                    options = env_class.Options.model_validate(message["options"])
                    answer = _observed(env.reset(message["seed"], options), env)
                else:
                    answer = _stepped(play_turn(env, message["reply"], host_options), env)
                reply = frame(answer)
            except EnvFailure as exc:
                reply = frame({"failure": str(exc)})
            except Exception as exc:  # the env broke its contract: the server closes the instance
                traceback.print_exc()
                reply = frame({"failure": f"{type(exc).__name__}: {exc}"})
            conn.sendall(reply)
    finally:
        env.close()
        with contextlib.suppress(OSError):  # the server went away: nobody waits for the answer
            conn.sendall(frame({"closed": True}))


def _observed(observed: Observation, env: Env) -> dict[str, Any]:
    return {"observation": observed.observation, "info": observed.info, "actions": env.available_actions()}


def _stepped(step: Step, env: Env) -> dict[str, Any]:
    return {
        "observation": step.observation,
        "reward": step.reward,
        "done": step.done,
        "info": step.info,
        "actions": env.available_actions(),
    }


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent ends: no instance outlives its server,
    even one spinning in env code that never reads its socket again."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_child(socket_path: str, token: str, env_class: type[Env]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # env code may run subprocesses and wait on them
    _die_with_parent()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a print() in env code must not corrupt the zygote's replies on stdout
    random.seed()  # children would all share the zygote's state of the global RNG
    gc.unfreeze()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    serve_instance(conn, token, env_class)


def _report(message: dict[str, Any]) -> None:
    os.write(1, orjson.dumps(message) + b"\n")  # one write, shorter than PIPE_BUF: never interleaved


def _reap(signum: int, frame_: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report({"exited": pid, "how": describe_exit(status)})


def describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def main(argv: list[str]) -> None:
    socket_path, locators = argv[0], argv[1:]
    _die_with_parent()
    try:
        classes = {cls.env_id(): cls for cls in map(load_env_path, locators)}
        for env_class in classes.values():
            env_class.prepare()
    except Exception as exc:
        _report({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(2) from None
    gc.collect()
    gc.freeze()  # what start-up made is shared with every child; a collection must not touch it
    signal.signal(signal.SIGCHLD, _reap)
    _report({"ready": sorted(classes)})
    for line in sys.stdin.buffer:  # ends when the server closes our stdin, or dies
        request = orjson.loads(line)
        pid = os.fork()
        if pid:
            _report({"forked": pid, "token": request["token"]})
        else:
            code = 0
            try:
                _run_child(socket_path, request["token"], classes[request["env"]])
            except BaseException:  # a child must never return into the zygote's loop
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
