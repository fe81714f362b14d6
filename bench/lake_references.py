"""What a held-out success rate on FrozenLake means: reference policies on the same maps.

A learning target such as "0.5 held-out success" is only meaningful beside what policies of known
skill score on the very maps it is measured on. This plays the recipe's held-out seeds (its env
options and turn limit) with three policies written out by hand, through the env class itself:

* **the best blind route**: the one fixed sequence of moves that reaches the goal on the most
  maps, found by exhaustive search (pruned: a prefix is dropped when even every map still on the
  ice reaching the goal could not beat the best so far); it never looks at the map;
* **"Right unless a hole, else Down"** (and its mirror): reads only the two tiles next to the
  player, from the observation text the model sees;
* **a shortest path**: reads the whole map (breadth-first search over the env's states).

With ``--trajectories`` (a ``stargym eval`` / ``bench/learning.py`` held-out ``trajectories.jsonl``),
it also splits a policy's success by whether the best blind route solves the map: success on the
maps it does not solve is what only a policy that reads the map can earn.
Results go to ``bench/results/lake-references.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is first on sys.path and bench/env_server.py would shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT / "bench"]
sys.path.insert(0, str(REPO_ROOT))

from env_server.envs.game.frozenlake import (  # noqa: E402
    ACTION_NAMES,
    ACTIONS,
    HOLE,
    MOVES,
    PLAYER,
    FrozenLakeEnv,
    FrozenLakeOptions,
)
from services.rollout_protocol import Trajectory  # noqa: E402
from trainer.config import load_config  # noqa: E402

ENV_ID = "game/frozenlake"
Policy = Callable[[str], str]
"""Observation text -> action name."""


@dataclass(frozen=True)
class Lake:
    """One held-out map: its seed and the env's options."""

    seed: int
    options: FrozenLakeOptions

    def reset(self) -> tuple[FrozenLakeEnv, str]:
        env = FrozenLakeEnv()
        return env, env.reset(self.seed, self.options).observation


def play(lake: Lake, policy: Policy, max_turns: int) -> bool:
    """Whether ``policy`` reaches the goal within ``max_turns`` moves."""
    env, text = lake.reset()
    for _ in range(max_turns):
        step = env.step(policy(text))
        if step.done:
            return bool(step.info.get("success"))
        text = step.observation
    return False


def solves_by_route(lake: Lake, route: str | tuple[str, ...], max_turns: int) -> bool:
    """Whether the fixed ``route`` (action names) reaches the goal."""
    moves = iter(route)
    return play(lake, lambda _text: next(moves, ACTION_NAMES[0]), min(max_turns, len(route)))


def best_blind_route(lakes: list[Lake], max_turns: int) -> tuple[tuple[str, ...], int]:
    """The fixed route of at most ``max_turns`` moves that solves the most ``lakes``, and how many.

    Depth-first over routes with every map's env advanced one move per level (a copy per branch:
    the lake is deterministic, so a copy is its state); a prefix is cut when the maps it solved
    plus every map still on the ice cannot beat the best route found so far. The route returned
    is :func:`shortest_equivalent` of the one found.
    """
    best: tuple[tuple[str, ...], int] = ((), -1)
    # Tried in this order so that, of routes solving as many maps, the one kept heads for the goal
    # corner first rather than bumping into the start corner's edges (strict > keeps the first).
    toward_the_goal_first = ("Right", "Down", "Left", "Up")

    def search(route: tuple[str, ...], alive: list[FrozenLakeEnv], solved: int) -> None:
        nonlocal best
        if solved > best[1]:
            best = (route, solved)
        if len(route) == max_turns or solved + len(alive) <= best[1]:
            return
        for action in toward_the_goal_first:
            still, reached = [], solved
            for env in alive:
                moved = copy.copy(env)
                step = moved.step(action)
                if not step.done:
                    still.append(moved)
                elif step.info.get("success"):
                    reached += 1
            search((*route, action), still, reached)

    search((), [lake.reset()[0] for lake in lakes], 0)
    return shortest_equivalent(best[0], lakes, max_turns), best[1]


def shortest_equivalent(route: tuple[str, ...], lakes: list[Lake], max_turns: int) -> tuple[str, ...]:
    """``route`` without the moves whose removal solves no fewer ``lakes`` (bumps into an edge)."""
    solved = sum(solves_by_route(lake, route, max_turns) for lake in lakes)
    index = 0
    while index < len(route):
        shorter = route[:index] + route[index + 1 :]
        if sum(solves_by_route(lake, shorter, max_turns) for lake in lakes) >= solved:
            route = shorter
        else:
            index += 1
    return route


def grid(text: str) -> list[list[str]]:
    """The tiles of an observation: its lines up to the sentence, one symbol per tile."""
    return [line.split(" ") for line in text.splitlines()[:-1]]


def prefer(first: str, then: str) -> Policy:
    """Move ``first`` unless that is the edge or a hole, else ``then``, else ``first`` anyway."""

    def policy(text: str) -> str:
        tiles = grid(text)
        row, column = next(
            (r, c) for r, line in enumerate(tiles) for c, tile in enumerate(line) if tile == PLAYER
        )
        for action in (first, then):
            d_row, d_column = MOVES[ACTIONS[action.lower()]]  # the env's own moves
            r, c = row + d_row, column + d_column
            if 0 <= r < len(tiles) and 0 <= c < len(tiles) and tiles[r][c] != HOLE:
                return action
        return first

    return policy


def shortest_path_solves(lake: Lake, max_turns: int) -> bool:
    """Whether the goal is within ``max_turns`` moves: breadth-first over the env's states, an
    observation text standing for its state (it shows the player's tile)."""
    env, text = lake.reset()
    frontier, seen = [env], {text}
    for _ in range(max_turns):
        following = []
        for state in frontier:
            for action in ACTION_NAMES:
                moved = copy.copy(state)
                step = moved.step(action)
                if step.info.get("success"):
                    return True
                if not step.done and step.observation not in seen:
                    seen.add(step.observation)
                    following.append(moved)
        frontier = following
    return False


def held_out_lakes(config_path: Path) -> tuple[list[Lake], int]:
    """The recipe's held-out maps (its FrozenLake env's held-out options) and turn limit."""
    config = load_config(config_path)
    lakes_env = next((env for env in config.envs.mix if env.id == ENV_ID), None)
    if lakes_env is None:
        raise SystemExit(f"{config_path}: no {ENV_ID} in envs.mix")
    options = FrozenLakeOptions(**(lakes_env.held_out_options or {}))
    if options.slippery:
        raise SystemExit(
            f"{config_path}: a slippery lake has no fixed best route; references need slippery: false"
        )
    seeds = config.envs.eval_seeds
    count = min(config.eval.episodes or len(seeds), len(seeds))
    return [Lake(seeds.start + index, options) for index in range(count)], config.eval_max_turns


def trajectories(path: Path) -> Iterator[Trajectory]:
    for line in path.read_text().splitlines():
        if line.strip():
            yield Trajectory.model_validate_json(line)


def split_by_blind_route(path: Path, route: tuple[str, ...], max_turns: int) -> dict[str, Any]:
    """A policy's held-out success on the maps ``route`` solves and on the maps it does not."""
    counts = {True: [0, 0], False: [0, 0]}  # blind route solves the map -> [episodes, successes]
    for trajectory in trajectories(path):
        lake = Lake(trajectory.seed, FrozenLakeOptions(**(trajectory.options or {})))
        tally = counts[solves_by_route(lake, route, max_turns)]
        tally[0] += 1
        tally[1] += int(trajectory.success)
    episodes = counts[True][0] + counts[False][0]
    return {
        "trajectories": str(path),
        "episodes": episodes,
        "success": (counts[True][1] + counts[False][1]) / max(episodes, 1),
        "maps_blind_route_solves": {
            "episodes": counts[True][0],
            "success": counts[True][1] / max(counts[True][0], 1),
        },
        "maps_it_does_not": {
            "episodes": counts[False][0],
            "success": counts[False][1] / max(counts[False][0], 1),
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", type=Path, default=Path("configs/frozenlake-tiny.yaml"), help="The recipe."
    )
    parser.add_argument(
        "--trajectories",
        type=Path,
        nargs="*",
        default=[],
        help="Held-out trajectories.jsonl of policies to split by whether the best blind route solves the map.",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/lake-references.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    lakes, max_turns = held_out_lakes(args.config)
    route, blind_solved = best_blind_route(lakes, max_turns)

    def rate(solves: Callable[[Lake], bool]) -> float:
        return sum(solves(lake) for lake in lakes) / len(lakes)

    references = {
        f"best blind route ({' '.join(route)})": blind_solved / len(lakes),
        "Right unless a hole, else Down": rate(lambda lake: play(lake, prefer("Right", "Down"), max_turns)),
        "Down unless a hole, else Right": rate(lambda lake: play(lake, prefer("Down", "Right"), max_turns)),
        "a shortest path": rate(lambda lake: shortest_path_solves(lake, max_turns)),
    }
    print(f"{len(lakes)} held-out maps of {args.config}, {max_turns} turns:")
    for name, success in references.items():
        print(f"  {success:5.2f}  {name}")
    splits = [split_by_blind_route(path, route, max_turns) for path in args.trajectories]
    for split in splits:
        solved, unsolved = split["maps_blind_route_solves"], split["maps_it_does_not"]
        print(
            f"{split['trajectories']}: {split['success']:.2f} in all; {solved['success']:.2f} on the "
            f"{solved['episodes']} maps the blind route solves, {unsolved['success']:.2f} on the "
            f"{unsolved['episodes']} it does not"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": str(args.config),
        "maps": len(lakes),
        "max_turns": max_turns,
        "best_blind_route": list(route),
        "references": references,
        "policies": splits,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
