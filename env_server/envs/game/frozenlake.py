"""Gymnasium's FrozenLake as a text game: walk across the ice to the goal without falling into a hole.

The map is gymnasium's own ``generate_random_map`` for the seed, so a level here is a level there.
The stepping is reimplemented (the same moves, edge clamping and slip rule as FrozenLake-v1)
because building gymnasium's env computes a transition table for every tile, which costs more than
a whole episode of ours; episodes run inline on the server's event loop, so reset must stay cheap.
The lake is not slippery by default: an agent must be able to learn a deterministic path first.

The text is RAGEN's grid, one symbol per tile separated by spaces, followed by one short sentence
from a small fixed set: the default tiny policy has a word-level vocabulary built from it.
"""

from __future__ import annotations

import random
from collections import deque

from gymnasium.envs.toy_text.frozen_lake import DOWN, LEFT, RIGHT, UP, generate_random_map
from pydantic import BaseModel, ConfigDict, Field

from env_server.core import Env, Observation, Step

ACTIONS = {"left": LEFT, "down": DOWN, "right": RIGHT, "up": UP}
ACTION_NAMES = ["Left", "Down", "Right", "Up"]  # gymnasium's action order
MOVES = {LEFT: (0, -1), DOWN: (1, 0), RIGHT: (0, 1), UP: (-1, 0)}

PLAYER, FROZEN, HOLE, GOAL, PLAYER_IN_HOLE, PLAYER_ON_GOAL = "P", "_", "O", "G", "X", "√"

PROMPT = "Reach G and avoid O."
INVALID = "Invalid action. " + PROMPT
FELL = "You fell into a hole."
REACHED = "You reached the goal."


class FrozenLakeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Bounds keep the worst-case map generation (gymnasium redraws until the goal is reachable)
    # in the low milliseconds: it runs on the event loop. Below p≈0.6 valid maps get rare.
    size: int = Field(default=4, ge=2, le=10, description="Side of the square map.")
    p: float = Field(default=0.8, ge=0.6, le=1.0, description="Probability that a tile is frozen.")
    slippery: bool = Field(
        default=False, description="Each move goes in the chosen or a perpendicular direction (1/3 each)."
    )
    random_start_goal: bool = Field(
        default=False,
        description="Put start and goal on random distinct frozen tiles (goal reachable) instead of the corners.",
    )


class FrozenLakeEnv(Env):
    name = "frozenlake"
    family = "game"
    instruction = (
        "You are walking on a frozen lake shown as a grid. Symbols: P is you, _ is frozen ice, "
        "O is a hole, G is the goal, X is you in a hole, √ is you on the goal. Walk to the goal "
        "without falling into a hole; moving into the edge of the lake leaves you in place. "
        "You get reward 1 when you reach the goal. Reply with one action: Left, Down, Right or Up."
    )
    action_format = "one of Left, Down, Right, Up, e.g. 'Right'"
    default_max_turns = 8
    reward_range = (0.0, 1.0)
    Options = FrozenLakeOptions
    runs_inline = True
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py

    def __init__(self) -> None:
        self._rng = random.Random()
        self._size = 0
        self._holes: frozenset[tuple[int, int]] = frozenset()
        self._goal = (0, 0)
        self._player = (0, 0)
        self._slippery = False

    def reset(self, seed: int, options: FrozenLakeOptions) -> Observation:
        self._rng = random.Random(seed)
        self._size = options.size
        self._slippery = options.slippery
        rows = generate_random_map(options.size, options.p, seed)
        self._holes = frozenset(_tiles(rows, "H"))
        if options.random_start_goal:
            self._player, self._goal = self._draw_start_goal()
        else:
            self._player, self._goal = _tiles(rows, "S")[0], _tiles(rows, "G")[0]
        return Observation(self._render(PROMPT))

    def available_actions(self) -> list[str]:
        return list(ACTION_NAMES)

    def step(self, action: str) -> Step:
        move = ACTIONS.get(action.strip().strip(".'\"").strip().lower())
        if move is None:
            return Step(self._render(INVALID), 0.0, False, {"valid": False})
        if self._slippery:
            move = (move + self._rng.choice((-1, 0, 1))) % 4
        self._player = self._moved(self._player, move)
        if self._player == self._goal:
            return Step(self._render(REACHED), 1.0, True, {"valid": True, "success": True})
        if self._player in self._holes:
            return Step(self._render(FELL), 0.0, True, {"valid": True, "success": False})
        return Step(self._render(PROMPT), 0.0, False, {"valid": True})

    def _moved(self, position: tuple[int, int], move: int) -> tuple[int, int]:
        """One tile in the move's direction, staying in place at the edge (as gymnasium does)."""
        d_row, d_col = MOVES[move]
        last = self._size - 1
        return min(max(position[0] + d_row, 0), last), min(max(position[1] + d_col, 0), last)

    def _draw_start_goal(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """A random start with a frozen neighbour, and a random goal among the tiles it can reach.

        Drawing the goal from the start's reachable tiles makes every draw valid, so there is no
        redraw loop; gymnasium's map always joins its corners, so such a start exists.
        """
        frozen = [(r, c) for r in range(self._size) for c in range(self._size) if (r, c) not in self._holes]
        starts = [tile for tile in frozen if any(self._is_ice(n) for n in self._neighbours(tile))]
        start = self._rng.choice(starts)
        reachable = sorted(self._reachable(start) - {start})
        return start, self._rng.choice(reachable)

    def _reachable(self, start: tuple[int, int]) -> set[tuple[int, int]]:
        seen = {start}
        frontier = deque([start])
        while frontier:
            for tile in self._neighbours(frontier.popleft()):
                if tile not in seen and self._is_ice(tile):
                    seen.add(tile)
                    frontier.append(tile)
        return seen

    def _neighbours(self, tile: tuple[int, int]) -> list[tuple[int, int]]:
        return [moved for move in MOVES if (moved := self._moved(tile, move)) != tile]

    def _is_ice(self, tile: tuple[int, int]) -> bool:
        return tile not in self._holes

    def _render(self, sentence: str) -> str:
        rows = []
        for r in range(self._size):
            rows.append(" ".join(self._symbol((r, c)) for c in range(self._size)))
        return "\n".join(rows) + "\n" + sentence

    def _symbol(self, tile: tuple[int, int]) -> str:
        if tile == self._player:
            return PLAYER_ON_GOAL if tile == self._goal else PLAYER_IN_HOLE if tile in self._holes else PLAYER
        return GOAL if tile == self._goal else HOLE if tile in self._holes else FROZEN


def _tiles(rows: list[str], letter: str) -> list[tuple[int, int]]:
    return [(r, c) for r, row in enumerate(rows) for c, tile in enumerate(row) if tile == letter]
