"""Which HTTP library should the env client use? Client CPU per step, measured against a real server.

Each (library, concurrency) pair runs in its own client process, so its CPU time
(``time.process_time``: every thread of the process, Rust runtimes included) is the client's
alone; the server runs in another process. Every client task owns one env instance and steps it
with an invalid action (the instance never finishes), so each request is the same
``POST /instances/{id}/step``.

    .venv/bin/python bench/http_clients.py [--libs httpx,aiohttp,...] [--seconds 2]

Libraries that are not installed are skipped; the env client itself uses the winner (aiohttp).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.env_server import CLK_TCK, EnvServerProcess, machine_busy_seconds  # noqa: E402

STEP_BODY = orjson.dumps({"action": "no such action"})
HEADERS = {"content-type": "application/json"}


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Adapter:
    """The smallest surface the benchmark needs: POST bytes, get (status, bytes) back."""

    async def open(self, base_url: str, pool: int) -> None:
        raise NotImplementedError

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


class Httpx(Adapter):
    async def open(self, base_url: str, pool: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        self.client = httpx.AsyncClient(limits=limits, timeout=30.0)

    async def post(self, url, body):
        response = await self.client.post(url, content=body, headers=HEADERS)
        return response.status_code, response.content

    async def aclose(self):
        await self.client.aclose()


class Aiohttp(Adapter):
    async def open(self, base_url: str, pool: int) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=pool, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=30), auto_decompress=False
        )

    async def post(self, url, body):
        async with self.session.post(url, data=body, headers=HEADERS) as response:
            return response.status, await response.read()

    async def aclose(self):
        await self.session.close()


class AiohttpNoKeepalive(Aiohttp):
    """aiohttp with a new connection per request (``force_close``): what keep-alive saves."""

    async def open(self, base_url: str, pool: int) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=pool, force_close=True)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30))


class AiohttpSmallPool(Aiohttp):
    """aiohttp with at most 16 connections, requests queueing for them beyond that."""

    async def open(self, base_url: str, pool: int) -> None:
        await super().open(base_url, min(pool, 16))


class AiohttpSemaphore16(Aiohttp):
    """aiohttp with unlimited connections behind a FIFO ``asyncio.Semaphore(16)``."""

    async def open(self, base_url: str, pool: int) -> None:
        await super().open(base_url, 0)
        self.gate = asyncio.Semaphore(16)

    async def post(self, url, body):
        async with self.gate:
            return await super().post(url, body)


class Aiosonic(Adapter):
    async def open(self, base_url: str, pool: int) -> None:
        import aiosonic
        from aiosonic.pools import PoolConfig

        connector = aiosonic.TCPConnector(pool_configs={":default": PoolConfig(size=pool)})
        self.client = aiosonic.HTTPClient(connector)

    async def post(self, url, body):
        response = await self.client.post(url, data=body, headers=HEADERS)
        return response.status_code, await response.content()


class Pyreqwest(Adapter):
    async def open(self, base_url: str, pool: int) -> None:
        from pyreqwest.client import ClientBuilder

        self.client = ClientBuilder().max_connections(pool).build()

    async def post(self, url, body):
        response = await self.client.post(url).body_bytes(body).headers(HEADERS).build().send()
        return response.status, bytes(await response.bytes())

    async def aclose(self):
        await self.client.close()


class Niquests(Adapter):
    async def open(self, base_url: str, pool: int) -> None:
        import niquests

        self.session = niquests.AsyncSession(pool_connections=1, pool_maxsize=pool)

    async def post(self, url, body):
        response = await self.session.post(url, data=body, headers=HEADERS)
        return response.status_code, response.content

    async def aclose(self):
        await self.session.close()


class CurlCffi(Adapter):
    async def open(self, base_url: str, pool: int) -> None:
        from curl_cffi.requests import AsyncSession

        self.session = AsyncSession(max_clients=pool)

    async def post(self, url, body):
        response = await self.session.post(url, data=body, headers=HEADERS)
        return response.status_code, response.content

    async def aclose(self):
        await self.session.close()


class EnvClientAdapter(Adapter):
    """stargym's own EnvClient (aiohttp underneath, plus pydantic models of the results)."""

    async def open(self, base_url: str, pool: int) -> None:
        from services.env_client import EnvClient

        self.client = EnvClient(base_url, max_connections=pool)
        await self.client.__aenter__()

    async def aclose(self):
        await self.client.__aexit__(None, None, None)


ADAPTERS: dict[str, type[Adapter]] = {
    "httpx": Httpx,
    "aiohttp": Aiohttp,
    "aiohttp-no-keepalive": AiohttpNoKeepalive,
    "aiohttp-pool16": AiohttpSmallPool,
    "aiohttp-sem16": AiohttpSemaphore16,
    "aiosonic": Aiosonic,
    "pyreqwest": Pyreqwest,
    "niquests": Niquests,
    "curl_cffi": CurlCffi,
    "EnvClient": EnvClientAdapter,
}
IMPORT_NAMES = {"curl_cffi": "curl_cffi", "EnvClient": "aiohttp"}


async def measure(
    lib: str, base_url: str, concurrency: int, seconds: float, env: str, server_pid: int
) -> dict:
    adapter = ADAPTERS[lib]()
    await adapter.open(base_url, concurrency)
    import aiohttp

    async with aiohttp.ClientSession() as setup:  # instances are made the same way for every library
        ids = []
        for _ in range(concurrency):
            async with setup.post(f"{base_url}/instances", json={"env": env, "seed": 1}) as response:
                ids.append((await response.json())["instance_id"])
    latencies: list[float] = []
    stop_at = 0.0
    counting = False
    steps = 0
    errors = 0

    if isinstance(adapter, EnvClientAdapter):

        async def one_step(instance_id: str) -> None:
            await adapter.client.step(instance_id, "no such action")
    else:

        async def one_step(instance_id: str) -> None:
            status, body = await adapter.post(f"{base_url}/instances/{instance_id}/step", STEP_BODY)
            orjson.loads(body)
            if status != 200:
                raise RuntimeError(f"status {status}: {body[:200]!r}")

    async def task(instance_id: str) -> None:
        nonlocal steps, errors
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return
            try:
                await one_step(instance_id)
            except Exception:
                errors += 1
                continue
            if counting:
                steps += 1
                latencies.append(time.perf_counter() - started)

    stop_at = time.perf_counter() + 0.5  # warm up: connections opened, code paths hot
    await asyncio.gather(*(task(i) for i in ids))
    counting = True
    cpu0, wall0 = time.process_time(), time.perf_counter()
    machine0, server0 = machine_busy_seconds(), process_cpu_seconds(server_pid)
    stop_at = wall0 + seconds
    await asyncio.gather(*(task(i) for i in ids))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    server_cpu = process_cpu_seconds(server_pid) - server0
    others = machine_busy_seconds() - machine0 - cpu - server_cpu
    await adapter.aclose()
    latencies.sort()
    return {
        "lib": lib,
        "concurrency": concurrency,
        "steps": steps,
        "errors": errors,
        "steps_per_s": steps / wall,
        "client_cpu_ms_per_step": 1000 * cpu / max(steps, 1),
        "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
        "server_cpu_ms_per_step": 1000 * server_cpu / max(steps, 1),
        "other_processes_cores": round(max(0.0, others) / wall, 2),
    }


def worker(args: argparse.Namespace) -> None:
    if args.uvloop:
        import uvloop

        uvloop.install()
    result = asyncio.run(
        measure(args.worker, args.url, args.concurrency, args.seconds, args.env, args.server_pid)
    )
    result["loop"] = "uvloop" if args.uvloop else "asyncio"
    print(json.dumps(result))


def installed(lib: str) -> bool:
    import importlib.util

    name = IMPORT_NAMES.get(lib, lib.split("-")[0])
    return importlib.util.find_spec(name) is not None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--libs", default=",".join(ADAPTERS))
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--uvloop", action="store_true", help="Run the client on uvloop.")
    parser.add_argument("--env", default=None, help="Env id; default game/frozenlake, else game/bandit.")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "http_clients.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--python", default=sys.executable, help="Interpreter of the client processes.")
    args = parser.parse_args()
    if args.worker:
        args.concurrency = int(args.concurrency)
        worker(args)
        return

    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=130)
    results = []
    with EnvServerProcess() as server:
        env = args.env or server.bench_env
        for lib in args.libs.split(","):
            if not installed(lib):
                console.print(f"[yellow]{lib} not installed: skipped")
                continue
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                command = [
                    args.python,
                    __file__,
                    "--worker",
                    lib,
                    "--url",
                    server.url,
                    "--server-pid",
                    str(server.process.pid),
                    "--concurrency",
                    str(concurrency),
                    "--seconds",
                    str(args.seconds),
                    "--env",
                    env,
                ] + (["--uvloop"] if args.uvloop else [])
                done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
                if done.returncode != 0:
                    console.print(f"[red]{lib} x{concurrency} failed:\n{done.stderr[-2000:]}")
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results.append(result)
                console.print(
                    f"{lib:22} x{concurrency:<4} {result['steps_per_s']:8.0f} steps/s  "
                    f"client CPU {result['client_cpu_ms_per_step']:.3f} ms/step  "
                    f"p50 {result['p50_ms']:.2f} ms  p99 {result['p99_ms']:.2f} ms  errors {result['errors']}  "
                    f"(other processes: {result['other_processes_cores']:.1f} cores)"
                )
    table = Table(title=f"HTTP client libraries: client CPU per step ({os.cpu_count()} cores, shared)")
    for column in ("library", "clients", "steps/s", "client CPU ms/step", "p50 ms", "p99 ms", "other procs"):
        table.add_column(column, justify="right" if column != "library" else "left")
    for r in results:
        table.add_row(
            r["lib"],
            str(r["concurrency"]),
            f"{r['steps_per_s']:.0f}",
            f"{r['client_cpu_ms_per_step']:.3f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['other_processes_cores']:.1f}",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    loop = "uvloop" if args.uvloop else "asyncio"
    args.out.write_text(json.dumps({"env": env, "client_loop": loop, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
