"""What running an env instance in a process of its own costs (env_server/sandbox.py), per game env.

For each game env, the host's ``InstancePool`` (no HTTP) drives the same play twice in this
process: with the env in the server's process (its trusted path: inline or on a thread) and
sandboxed (one child process per instance, every call a length-prefixed JSON exchange over a
Unix socket). Reported per env:

* steps/s and µs per step with one instance (the added latency of a step) and with 16 instances
  stepped concurrently (throughput, where the children overlap on the machine's cores);
* creates+closes per second (a fork of the zygote, a connection, a reset, then the child's exit);
* memory per sandboxed instance: the proportional set size (PSS) of 16 live children, which
  counts the pages they share copy-on-write with the zygote once among them.

Results go to ``bench/results/sandbox.json``.

    .venv/bin/python bench/sandbox.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from env_server.core import Env  # noqa: E402
from env_server.pool import InstancePool  # noqa: E402
from env_server.registry import load_family  # noqa: E402
from env_server.sandbox import SandboxHost  # noqa: E402

MAX_EPISODE_STEPS = 100  # a random walk that neither falls nor arrives is reset after this many
CONCURRENT = 16


async def play(pool: InstancePool, env_id: str, instances: int, seconds: float) -> float:
    """Steps/s of ``instances`` concurrent players, each its own instance, random valid actions."""
    created = [(await pool.create(env_id, seed, None))[0] for seed in range(instances)]
    steps = 0
    deadline = time.perf_counter() + seconds

    async def player(index: int) -> None:
        nonlocal steps
        instance = created[index]
        actions = instance.runner.available_actions() or ["noop"]
        rng, episode_steps = random.Random(index), 0
        while time.perf_counter() < deadline:
            result = await pool.step(instance.instance_id, rng.choice(actions))
            steps += 1
            episode_steps += 1
            if result.done or episode_steps >= MAX_EPISODE_STEPS:
                await pool.reset(instance.instance_id, steps, None)
                episode_steps = 0

    started = time.perf_counter()
    await asyncio.gather(*(player(i) for i in range(instances)))
    rate = steps / (time.perf_counter() - started)
    for instance in created:
        await pool.close(instance.instance_id)
    return rate


async def churn(pool: InstancePool, env_id: str, seconds: float) -> float:
    """Creates+closes per second, one after another."""
    count = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        instance, _ = await pool.create(env_id, count, None)
        await pool.close(instance.instance_id)
        count += 1
    return count / (time.perf_counter() - started)


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


async def memory_per_instance(pool: InstancePool, env_id: str) -> float:
    """MiB of PSS per live sandboxed instance, over ``CONCURRENT`` of them."""
    created = [(await pool.create(env_id, seed, None))[0] for seed in range(CONCURRENT)]
    pids = [instance.runner.pid for instance in created]
    total = sum(pss_kib(pid) for pid in pids if pid is not None)
    for instance in created:
        await pool.close(instance.instance_id)
    return total / len(created) / 1024


async def bench_env(env_class: type[Env], seconds: float) -> dict[str, Any]:
    env_id = env_class.env_id()
    local = InstancePool({env_id: env_class}, max_instances=64, ttl_s=3600)
    host = SandboxHost({env_id: env_class}, step_timeout_s=30)
    await host.start()
    sandboxed = InstancePool({env_id: env_class}, max_instances=64, ttl_s=3600, sandbox=host)
    try:
        row: dict[str, Any] = {"env": env_id, "inline": env_class.runs_inline}
        for name, pool in (("local", local), ("sandboxed", sandboxed)):
            row[f"{name}_steps_per_s_1"] = await play(pool, env_id, 1, seconds)
            row[f"{name}_steps_per_s_{CONCURRENT}"] = await play(pool, env_id, CONCURRENT, seconds)
            row[f"{name}_creates_per_s"] = await churn(pool, env_id, seconds)
        row["sandboxed_pss_mib_per_instance"] = await memory_per_instance(sandboxed, env_id)
    finally:
        await host.stop()
    row["added_us_per_step"] = 1e6 / row["sandboxed_steps_per_s_1"] - 1e6 / row["local_steps_per_s_1"]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\nOne process per instance (sandboxed) against the env in the server's process (local), pool level, no HTTP"
    )
    print(
        f"| env | local steps/s (1 / {CONCURRENT}) | sandboxed steps/s (1 / {CONCURRENT}) "
        "| added µs/step | creates+closes/s local / sandboxed | PSS MiB/instance |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['env']}{' (inline)' if r['inline'] else ''} "
            f"| {r['local_steps_per_s_1']:,.0f} / {r[f'local_steps_per_s_{CONCURRENT}']:,.0f} "
            f"| {r['sandboxed_steps_per_s_1']:,.0f} / {r[f'sandboxed_steps_per_s_{CONCURRENT}']:,.0f} "
            f"| {r['added_us_per_step']:,.0f} "
            f"| {r['local_creates_per_s']:,.0f} / {r['sandboxed_creates_per_s']:,.0f} "
            f"| {r['sandboxed_pss_mib_per_instance']:.1f} |"
        )


async def main(seconds: float) -> None:
    rows = [await bench_env(env_class, seconds) for env_class in load_family("game").values()]
    print_table(rows)
    out = REPO_ROOT / "bench" / "results" / "sandbox.json"
    out.write_text(json.dumps({"seconds": seconds, "rows": rows}, indent=2) + "\n")
    print(f"\nresults: {out.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    asyncio.run(main(parser.parse_args().seconds))
