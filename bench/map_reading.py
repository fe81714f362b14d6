"""Does a FrozenLake policy read the map? Its moves conditioned on the tile beside the player.

Held-out success says how often a policy reaches the goal, not why. A policy that never looks at
the map can still score up to 0.43 on the recipe's held-out maps (the best blind route,
``bench/lake_references.py``); 0.5 needs a policy that avoids holes it can see. This reads that
off the turns a policy played: for every turn of a held-out ``trajectories.jsonl`` (``stargym
eval``, ``make demo``'s ``eval-after``, ``bench/learning.py --keep-runs``' ``held-out/policy-vN``),
the tile right of the player and the tile below it (ice, hole, goal or the lake's edge) and the
move the policy chose. A policy that reads the map moves Right less often with a hole to its right
than with ice there; a blind one moves Right as often either way. **The gap** P(move | ice) −
P(move | hole), for Right and for Down, is the number to watch: near 0 is blind.

    python bench/map_reading.py /work/runs/learning/learning-main-0/held-out/policy-v200/trajectories.jsonl
    python bench/map_reading.py /work/runs/learning/learning-main-0     # every held-out policy of a run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is first on sys.path and bench/env_server.py would shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT / "bench"]
sys.path.insert(0, str(REPO_ROOT))

from bench.lake_references import grid, trajectories  # noqa: E402
from env_server.envs.game.frozenlake import ACTIONS, GOAL, HOLE, MOVES, PLAYER  # noqa: E402

SIDES = ("Right", "Down")
"""The moves toward the goal (bottom-right): what a policy must stop doing beside a hole."""
KINDS = {HOLE: "hole", GOAL: "goal"}
"""A neighbour's kind by its symbol; anything else on the lake is ice."""
EDGE = "edge"
HELD_OUT = "held-out"
POLICY_DIR = re.compile(r"policy-v(\d+)$")


def neighbour(tiles: list[list[str]], side: str) -> str | None:
    """The kind of tile next to the player on ``side`` (``edge`` off the lake); None without a player."""
    position = next(
        ((r, c) for r, line in enumerate(tiles) for c, tile in enumerate(line) if tile == PLAYER), None
    )
    if position is None:  # the player stands in a hole or on the goal: the episode is over
        return None
    d_row, d_column = MOVES[ACTIONS[side.lower()]]  # the env's own moves
    row, column = position[0] + d_row, position[1] + d_column
    if not (0 <= row < len(tiles) and 0 <= column < len(tiles[row])):
        return EDGE
    return KINDS.get(tiles[row][column], "ice")


def move_rates(path: Path) -> dict[str, Any]:
    """For each side, P(that move | the kind of tile on that side) over the turns in ``path``."""
    seen: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    moved: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    turns = episodes = successes = 0
    for trajectory in trajectories(path):
        episodes += 1
        successes += int(trajectory.success)
        for turn in trajectory.turns:
            tiles = grid(turn.observation)
            chosen = turn.actions[0].strip().lower() if turn.actions else None
            for side in SIDES:
                kind = neighbour(tiles, side)
                if kind is None:
                    continue
                seen[side][kind] += 1
                moved[side][kind] += int(chosen == side.lower())
            turns += 1
    result: dict[str, Any] = {
        "trajectories": str(path),
        "success": successes / max(episodes, 1),
        "episodes": episodes,
        "turns": turns,
    }
    for side in SIDES:
        rates = {kind: moved[side][kind] / count for kind, count in sorted(seen[side].items())}
        result[side] = {"turns": dict(sorted(seen[side].items())), "rate": rates}
        if "ice" in rates and "hole" in rates:
            result[side]["gap"] = rates["ice"] - rates["hole"]
    return result


def held_out_files(target: Path) -> list[Path]:
    """``target`` itself if it is a file, else every ``held-out/policy-vN/trajectories.jsonl`` of a run by N."""
    if target.is_file():
        return [target]
    versions = []
    for directory in (target / HELD_OUT).glob("policy-v*"):
        match = POLICY_DIR.search(directory.name)
        if match and (directory / "trajectories.jsonl").is_file():
            versions.append((int(match.group(1)), directory / "trajectories.jsonl"))
    if not versions:
        raise SystemExit(f"{target}: neither a trajectories.jsonl nor a run with {HELD_OUT}/policy-vN/")
    return [path for _, path in sorted(versions)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "targets", type=Path, nargs="+", help="Held-out trajectories.jsonl files or run directories."
    )
    parser.add_argument("--out", type=Path, help="Write every result as JSON here too.")
    args = parser.parse_args()
    results = [move_rates(path) for target in args.targets for path in held_out_files(target)]
    for result in results:
        sides = []
        for side in SIDES:
            rates = result[side]["rate"]
            gap = result[side].get("gap")
            sides.append(
                f"{side} {rates.get('ice', 0):.2f} by ice, {rates.get('hole', 0):.2f} by a hole"
                + (f" (gap {gap:+.2f})" if gap is not None else "")
            )
        print(f"{result['trajectories']}: success {result['success']:.2f}; " + "; ".join(sides))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
