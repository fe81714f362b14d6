"""``make demo``: start the game env server and play episodes of every game with a random agent.

Everything goes through the real REST API with the same client rollout workers use, so what
the demo prints is what an agent sees. (The trainer's learning demo replaces this once the
trainer exists.)
"""

from __future__ import annotations

import asyncio
import random
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deploy.launcher import free_port, start_service
from services.env_client import EnvClient
from services.protocol import EnvSpec

EPISODES_PER_ENV = 3
SHOWN_EPISODES_PER_ENV = 1
GAME_PORT = 8101

console = Console()


@dataclass
class EpisodeLog:
    seed: int
    total_reward: float = 0.0
    success: bool = False
    invalid_actions: int = 0
    turns: list[tuple[str, float, bool]] = field(default_factory=list)


def pick_action(rng: random.Random, actions: list[str] | None, first_observation: str) -> str:
    """A uniformly random legal action; for open-text envs, a random line of the task text
    (TextCraft lists its crafting commands one per line, so these are well-formed attempts)."""
    if actions:
        return rng.choice(actions)
    return rng.choice([line for line in first_observation.splitlines() if line.strip()])


async def play_episode(client: EnvClient, spec: EnvSpec, seed: int) -> tuple[EpisodeLog, str]:
    rng = random.Random(seed)
    created = await client.create(spec.id, seed=seed)
    log = EpisodeLog(seed)
    try:
        for _ in range(spec.default_max_turns):
            action = pick_action(
                rng, await client.available_actions(created.instance_id), created.observation
            )
            result = await client.step(created.instance_id, action)
            log.total_reward += result.reward
            log.invalid_actions += not result.info.get("valid", True)
            log.turns.append((action, result.reward, result.done))
            if result.done:
                log.success = bool(result.info.get("success", False))
                break
    finally:
        await client.close(created.instance_id)
    return log, created.observation


def show_episode(spec: EnvSpec, log: EpisodeLog, first_observation: str) -> None:
    console.rule(f"[bold]{spec.id}[/] seed {log.seed}")
    console.print(first_observation, highlight=False)
    for turn, (action, reward, done) in enumerate(log.turns, start=1):
        console.print(f"  turn {turn}: [cyan]{action}[/] → reward {reward:+g}{'  (done)' if done else ''}")


async def play_all(url: str) -> Table:
    table = Table(title="Random agent, via the env server's REST API")
    for column in ("env", "episodes", "mean return", "success", "invalid actions"):
        table.add_column(column, justify="right" if column != "env" else "left")
    async with EnvClient(url) as client:
        for spec in await client.list_envs():
            logs = []
            for episode in range(EPISODES_PER_ENV):
                log, first_observation = await play_episode(client, spec, seed=episode)
                if episode < SHOWN_EPISODES_PER_ENV:
                    show_episode(spec, log, first_observation)
                logs.append(log)
            turns = sum(len(log.turns) for log in logs)
            table.add_row(
                spec.id,
                str(len(logs)),
                f"{sum(log.total_reward for log in logs) / len(logs):.2f}",
                f"{sum(log.success for log in logs)}/{len(logs)}",
                f"{sum(log.invalid_actions for log in logs)}/{turns}",
            )
    return table


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def main() -> None:
    port = GAME_PORT if port_is_free(GAME_PORT) else free_port()
    with tempfile.TemporaryDirectory(prefix="stargym-demo-") as log_dir:
        console.print(f"Starting the game env server on :{port} …")
        server = start_service("env-game", ["env", "serve", "game", "--port", str(port)], port, Path(log_dir))
        try:
            console.print(f"Env server up at {server.url} (OpenAPI at {server.url}/docs)\n")
            console.print(asyncio.run(play_all(server.url)))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
