"""Env servers do not leak: many instances created, stepped and closed leave RSS where it was.

For each family a real server plays instances one after another (``CONCURRENCY`` at a time):
create, up to ``STEPS`` steps (a listed action where the env lists them), close. RSS is read
after a warm-up (allocator pools, caches and the JIT-free interpreter's free lists fill up) and
again after ``STARGYM_LEAK_INSTANCES`` more (1,000 in ``make test``, ~2 minutes for all six
families; ``make soak`` runs 10,000): it must stay
within 10%. Every instance must be gone at the end, abandoned ones must be reaped, and no
ScienceWorld JVM may outlive its server.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import POLL, RunningServer, free_port, start_server, stop_server, wait_until

INSTANCES = int(os.environ.get("STARGYM_LEAK_INSTANCES", "1000"))
WARMUP = 300
CONCURRENCY = 8
STEPS = 3
GROWTH_LIMIT = 0.10
# Long enough that no instance being played is reaped between two of its requests on a loaded
# machine (3 s was not: in one `make test` a web/shop instance was reaped between its create and
# its first step, the other test worker busy), short enough for the reaper check to stay quick.
TTL_S = 8.0
# ScienceWorld creates lease a JVM and load a task (tens of ms to seconds each), so it plays a
# tenth as many, on a pool of two JVMs.
FAMILIES = {
    "game": (["game/bandit", "game/frozenlake", "game/sokoban", "game/textcraft"], 1.0),
    "embodied": (["embodied/babyai", "embodied/sciworld"], 0.1),
    "search": (["search/searchqa"], 1.0),
    "web": (["web/shop"], 1.0),
    "reasoning": (["reasoning/basic_arithmetic"], 1.0),
    "textarena": (["textarena/guess_the_number"], 1.0),
}
FALLBACK_REPLIES = ["look", "search[red shoes]", "<search>capital of France</search>", "42", "[5]"]
TIMEOUT = httpx.Timeout(120.0)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


def java_children(pid: int) -> set[int]:
    """Java processes whose parent is ``pid``: the server's JVMs."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if rest.split()[1] == str(pid) and comm.split("(", 1)[1] == "java":
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    family = request.param
    port = free_port()
    settings = {
        "STARGYM_INSTANCE_TTL_S": str(TTL_S),
        "STARGYM_REAPER_INTERVAL_S": "0.5",
        "STARGYM_SCIWORLD_POOL_SIZE": "2",
    }
    args = ["env", "serve", family, "--port", str(port)]
    server = start_server(args, port, tmp_path_factory.mktemp(f"leaks-{family}"), settings, family)
    yield server
    stop_server(server.process)


async def play(
    http: httpx.AsyncClient, env_ids: list[str], count: int, first_seed: int, jvms: set[int], pid: int
) -> None:
    """``count`` instances, ``CONCURRENCY`` at a time, each created, stepped and closed."""
    seeds = iter(range(first_seed, first_seed + count))

    async def player(index: int) -> None:
        rng = random.Random(index)
        for seed in seeds:
            env = env_ids[seed % len(env_ids)]
            created = await http.post("/instances", json={"env": env, "seed": seed})
            assert created.status_code == 201, created.text
            instance = created.json()["instance_id"]
            for _ in range(STEPS):
                listed = (await http.get(f"/instances/{instance}/available_actions")).json()
                action = rng.choice(listed or FALLBACK_REPLIES)
                stepped = await http.post(f"/instances/{instance}/step", json={"action": action})
                assert stepped.status_code == 200, stepped.text
                if stepped.json()["done"]:
                    break
            assert (await http.delete(f"/instances/{instance}")).status_code == 204
            if env == "embodied/sciworld":
                jvms.update(java_children(pid))

    await asyncio.gather(*(player(i) for i in range(CONCURRENCY)))


async def test_instances_leave_no_memory_behind(family_server: RunningServer) -> None:
    family = family_server.name
    env_ids, share = FAMILIES[family]
    pid = family_server.process.pid
    jvms: set[int] = set()
    async with httpx.AsyncClient(base_url=family_server.url, timeout=TIMEOUT) as http:
        try:
            await play(http, env_ids, max(1, int(WARMUP * share)), 0, jvms, pid)
            warm = rss_kib(pid)
            await play(http, env_ids, max(1, int(INSTANCES * share)), 10**6, jvms, pid)
        except httpx.TransportError as exc:  # say whether the server died, and what it logged
            raise AssertionError(
                f"{family}: {exc!r} (server exit code {family_server.process.poll()}); its log ends:\n"
                + family_server.log()[-4000:]
            ) from exc
        grown = rss_kib(pid) / warm - 1
        print(f"{family}: RSS {warm / 1024:.0f} MiB after the warm-up, {grown:+.1%} after {INSTANCES} more")
        assert grown <= GROWTH_LIMIT, f"{family}: RSS {warm} KiB after warm-up, then {grown:+.1%}"
        assert (await http.get("/instances")).json()["count"] == 0

        # Abandoned instances (a client that died) are reaped after the TTL.
        abandoned = [
            (await http.post("/instances", json={"env": env_ids[0], "seed": seed})).json()["instance_id"]
            for seed in range(20)
        ]
        wait_until(
            lambda: POLL.get(f"{family_server.url}/instances").json()["count"] == 0, "the reaper", 5 * TTL_S
        )
        for instance in abandoned:
            assert (await http.get(f"/instances/{instance}")).status_code == 404
    if "embodied/sciworld" in env_ids:
        assert len(jvms) > 0 and len(java_children(pid)) <= 2, jvms
        stop_server(family_server.process)
        wait_until(lambda: not any(map(alive, jvms)), "the server's JVMs to exit with it", 30)
