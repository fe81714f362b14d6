"""Sokoban, our own implementation: push every box onto a target.

gym-sokoban, which RAGEN and AgentGym use, is unmaintained and breaks on numpy 2, so this file
reimplements its level generator and rules. A room is generated per seed by *reverse play*, as
gym-sokoban does: a random walk carves the room, targets and the player are placed on the floor
with every box on its target, and the player then walks and *pulls* boxes backwards. Every pull
is the inverse of a push, so each state reached this way can be pushed back to the solved one:
generated rooms are solvable by construction. gym-sokoban's depth-first search is replaced by a
breadth-first one over (player, boxes) states with a state budget, which visits each state once;
the room kept is a state with the largest box displacement from the targets (ties broken by the
seeded RNG), never an already solved one.

Rewards follow gym-sokoban and RAGEN: −0.1 a step, +1 for a box pushed onto a target, −1 for one
pushed off, +10 when all boxes are on targets, which ends the episode. An invalid action moves
nothing but still costs the step penalty, so that a reply that is not an action is never cheaper
than a move. The text uses RAGEN's symbols, one per tile, separated by spaces.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from env_server.core import Env, Observation, Step

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "X", "√", "P", "S"
ACTION_NAMES = ["Up", "Down", "Left", "Right"]  # RAGEN's order

STEP_PENALTY = -0.1
BOX_ON_REWARD = 1.0
BOX_OFF_PENALTY = -1.0
SOLVED_REWARD = 10.0

PROMPT = "Push every X onto an O."
INVALID = "Invalid action. " + PROMPT
SOLVED = "All boxes are on targets."

# gym-sokoban's topology generator: 3×3 stamps carved around a walker that turns with this
# probability, for this many steps per unit of room height plus width.
STAMPS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
STAMP_OFFSETS = tuple(
    tuple((r - 1, c - 1) for r in range(3) for c in range(3) if stamp[r][c]) for stamp in STAMPS
)
TURN_PROBABILITY = 0.35
WALK_STEPS_PER_SIDE = 1.7
# Reverse play stops after this many distinct states; a 6×6 room with one box has at most ~240,
# so the budget only bounds generation time for big rooms with several boxes.
REVERSE_STATE_BUDGET = 10_000

Side = Annotated[int, Field(ge=5, le=12)]


class SokobanOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dim: tuple[Side, Side] = Field(default=(6, 6), description="Rows and columns, the outer wall included.")
    num_boxes: int = Field(default=1, ge=1, le=6)
    max_generation_tries: int = Field(
        default=100, ge=1, le=1000, description="Rooms drawn before giving up when none can be scrambled."
    )

    @model_validator(mode="after")
    def room_holds_boxes(self) -> SokobanOptions:
        inside = (self.dim[0] - 2) * (self.dim[1] - 2)
        if self.num_boxes > inside // 4:
            raise ValueError(f"a {self.dim[0]}x{self.dim[1]} room holds at most {inside // 4} boxes")
        return self


@dataclass(frozen=True, slots=True)
class Room:
    """A Sokoban state. Tiles are numbered ``row * cols + col``; everything not floor is wall."""

    rows: int
    cols: int
    floor: frozenset[int]
    targets: frozenset[int]
    boxes: frozenset[int]
    player: int

    def render(self) -> str:
        return "\n".join(
            " ".join(self._symbol(r * self.cols + c) for c in range(self.cols)) for r in range(self.rows)
        )

    def _symbol(self, tile: int) -> str:
        on_target = tile in self.targets
        if tile == self.player:
            return PLAYER_ON_TARGET if on_target else PLAYER
        if tile in self.boxes:
            return BOX_ON_TARGET if on_target else BOX
        if tile in self.floor:
            return TARGET if on_target else FLOOR
        return WALL


def parse_room(text: str) -> Room:
    """A room from its grid in RAGEN's symbols (spaces between tiles optional): hand-made levels."""
    grid = [line.replace(" ", "") for line in text.strip().splitlines()]
    cols = len(grid[0])
    if any(len(line) != cols for line in grid):
        raise ValueError("every row of a room needs the same number of tiles")
    tiles = {r * cols + c: symbol for r, line in enumerate(grid) for c, symbol in enumerate(line)}
    unknown = set(tiles.values()) - {WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET}
    players = [tile for tile, symbol in tiles.items() if symbol in (PLAYER, PLAYER_ON_TARGET)]
    if unknown:
        raise ValueError(f"unknown symbols {sorted(unknown)}; a room uses RAGEN's # _ O X √ P S")
    if len(players) != 1:
        raise ValueError(f"a room needs exactly one player, not {len(players)}")
    ring = grid[0] + grid[-1] + "".join(line[0] + line[-1] for line in grid)
    if set(ring) != {WALL}:
        raise ValueError("a room needs a wall all around: a move off the edge would wrap to the next row")
    room = Room(
        rows=len(grid),
        cols=cols,
        floor=frozenset(tile for tile, symbol in tiles.items() if symbol != WALL),
        targets=frozenset(t for t, s in tiles.items() if s in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET)),
        boxes=frozenset(tile for tile, symbol in tiles.items() if symbol in (BOX, BOX_ON_TARGET)),
        player=players[0],
    )
    if len(room.boxes) != len(room.targets) or not room.boxes:
        raise ValueError("a room needs as many boxes as targets, at least one")
    return room


def generate_room(rng: random.Random, options: SokobanOptions) -> Room:
    """A solvable, unsolved room drawn from ``rng``: carve, place, then scramble by reverse play."""
    rows, cols = options.dim
    for _ in range(options.max_generation_tries):
        floor = carve_floor(rng, rows, cols)
        if len(floor) < options.num_boxes + 2:
            continue
        player, *targets = rng.sample(sorted(floor), options.num_boxes + 1)
        room = reverse_play(rng, Room(rows, cols, floor, frozenset(targets), frozenset(targets), player))
        if room is not None:
            return room
    raise RuntimeError(
        f"no solvable {rows}x{cols} room with {options.num_boxes} boxes in {options.max_generation_tries} tries"
    )


def carve_floor(rng: random.Random, rows: int, cols: int) -> frozenset[int]:
    """gym-sokoban's room topology: a random walk stamping 3×3 shapes, the outer ring left as wall.

    Every stamp covers the walker's tile and the walker moves one tile at a time, so the floor is
    connected.
    """
    directions = ((1, 0), (0, 1), (-1, 0), (0, -1))
    row, col = rng.randint(1, rows - 2), rng.randint(1, cols - 2)
    d_row, d_col = rng.choice(directions)
    floor = set()
    for _ in range(int(WALK_STEPS_PER_SIDE * (rows + cols))):
        if rng.random() < TURN_PROBABILITY:
            d_row, d_col = rng.choice(directions)
        row, col = min(max(row + d_row, 1), rows - 2), min(max(col + d_col, 1), cols - 2)
        for o_row, o_col in rng.choice(STAMP_OFFSETS):
            r, c = row + o_row, col + o_col
            if 0 < r < rows - 1 and 0 < c < cols - 1:
                floor.add(r * cols + c)
    return frozenset(floor)


def reverse_play(rng: random.Random, solved: Room) -> Room | None:
    """The most scrambled unsolved state reachable from ``solved`` by walking and pulling boxes.

    Boxes keep their identity (box ``i`` starts on target ``i``), and the score is the total
    Manhattan distance of each box from its own target, as in gym-sokoban; an unsolved state has
    a box off its own target, so it scores at least 1. None when no box can be pulled at all.
    """
    cols = solved.cols
    floor = solved.floor
    origins = tuple(sorted(solved.targets))
    start = (solved.player, origins)
    seen = {start}
    frontier = deque([start])
    best_score, best = 0, []
    while frontier and len(seen) < REVERSE_STATE_BUDGET:
        player, boxes = frontier.popleft()
        for offset in (-cols, cols, -1, 1):
            to = player + offset
            if to not in floor or to in boxes:
                continue
            behind = player - offset
            successors = [(to, boxes)]
            if behind in boxes:
                successors.append((to, tuple(player if box == behind else box for box in boxes)))
            for state in successors:
                if state in seen:
                    continue
                seen.add(state)
                frontier.append(state)
                if solved.targets.issuperset(state[1]):
                    continue  # boxes swapped targets: still solved
                score = _displacement(state[1], origins, cols)
                if score > best_score:
                    best_score, best = score, [state]
                elif score == best_score:
                    best.append(state)
    if not best:
        return None
    player, boxes = rng.choice(best)
    return Room(solved.rows, cols, floor, solved.targets, frozenset(boxes), player)


def _displacement(boxes: tuple[int, ...], origins: tuple[int, ...], cols: int) -> int:
    return sum(
        abs(box // cols - origin // cols) + abs(box % cols - origin % cols)
        for box, origin in zip(boxes, origins, strict=True)
    )


class SokobanEnv(Env):
    name = "sokoban"
    family = "game"
    instruction = (
        "You are playing Sokoban in a room shown as a grid. Symbols: # is a wall, _ is empty floor, "
        "O is a target, X is a box, √ is a box on a target, P is you, S is you on a target. "
        "Push every box onto a target. You push a box by walking into it; you cannot pull boxes, "
        "and a box moves only into an empty tile or a target. Each step costs 0.1, a box pushed "
        "onto a target earns 1, one pushed off loses 1, and solving the room earns 10. "
        "Reply with one action: Up, Down, Left or Right."
    )
    action_format = "one of Up, Down, Left, Right, e.g. 'Left'"
    default_max_turns = 20
    reward_range = (STEP_PENALTY + BOX_OFF_PENALTY, STEP_PENALTY + BOX_ON_REWARD + SOLVED_REWARD)
    Options = SokobanOptions
    runs_inline = False
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py

    def __init__(self) -> None:
        self._room = Room(0, 0, frozenset(), frozenset(), frozenset(), 0)

    def reset(self, seed: int, options: SokobanOptions) -> Observation:
        return self.reset_to(generate_room(random.Random(seed), options))

    def reset_to(self, room: Room) -> Observation:
        """Start an episode from a given room (a hand-made level, or a situation under test)."""
        self._room = room
        return Observation(self._render(PROMPT), {"boxes_on_target": self._boxes_on_target()})

    def available_actions(self) -> list[str]:
        return list(ACTION_NAMES)

    def step(self, action: str) -> Step:
        name = action.strip().strip(".'\"").strip().capitalize()
        if name not in ACTION_NAMES:
            info = {"valid": False, "boxes_on_target": self._boxes_on_target()}
            return Step(self._render(INVALID), STEP_PENALTY, False, info)
        before = self._boxes_on_target()
        self._room = self._moved(self._room, name)
        after = self._boxes_on_target()
        # One box moves at most one tile, so the count changes by at most one either way.
        reward = STEP_PENALTY + (
            BOX_ON_REWARD if after > before else BOX_OFF_PENALTY if after < before else 0.0
        )
        info = {"valid": True, "boxes_on_target": after}
        if after == len(self._room.boxes):
            return Step(self._render(SOLVED), reward + SOLVED_REWARD, True, {**info, "success": True})
        return Step(self._render(PROMPT), reward, False, info)

    @staticmethod
    def _moved(room: Room, name: str) -> Room:
        """The room after the player tries to walk one tile; walls and blocked boxes stop it."""
        offset = {"Up": -room.cols, "Down": room.cols, "Left": -1, "Right": 1}[name]
        to = room.player + offset
        if to not in room.floor:
            return room
        if to not in room.boxes:
            return Room(room.rows, room.cols, room.floor, room.targets, room.boxes, to)
        beyond = to + offset
        if beyond not in room.floor or beyond in room.boxes:
            return room
        boxes = (room.boxes - {to}) | {beyond}
        return Room(room.rows, room.cols, room.floor, room.targets, boxes, to)

    def _boxes_on_target(self) -> int:
        return len(self._room.boxes & self._room.targets)

    def _render(self, sentence: str) -> str:
        return self._room.render() + "\n" + sentence
