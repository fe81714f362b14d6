"""reasoning-gym's item for an env's seed, and a correct answer to it, for the tests.

:func:`reasoning_gym_item` builds the dataset itself, so a test shows that an env asks
reasoning-gym's question, not merely the same text twice. :func:`reference_answer` is the item's
gold answer or one made: five datasets have no gold answer (``answer`` is None) because many answers are right and their
scorer checks a reply's validity: three keep an example answer in the item's metadata, and for
rush_hour and boxnet one is planned here (a BFS over boards, a box-by-box route).
"""

from __future__ import annotations

import json
import random
from collections import deque
from typing import Any

import reasoning_gym

from env_server.envs.reasoning.catalog import DEFAULT_ITEM_COUNT, ITEM_COUNTS

EXAMPLE_IN_METADATA = {
    "graph_color": "possible_answer",
    "propositional_logic": "example_answer",
    "rubiks_cube": "example_correct_answer",
}
BOARD = 6  # rush_hour's 6 x 6 board, a row-major string: 'o' empty, 'x' wall, a letter per car
EXIT = 2 * BOARD + BOARD - 2  # the red car's (A's) first cell when it is at the exit


def reasoning_gym_item(dataset: str, seed: int, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Item ``seed % item_count`` of reasoning-gym's seed-0 dataset, as the env's docs promise.

    list_functions draws from the process's ``random``, so reasoning-gym's own items of it are
    not reproducible; the env seeds ``random`` with the item's index, and so does this.
    """
    count = ITEM_COUNTS.get(dataset, DEFAULT_ITEM_COUNT)
    items = reasoning_gym.create_dataset(dataset, seed=0, size=count, **(config or {}))
    random.seed(seed % count)
    return items[seed % count]


def reference_answer(dataset: str, entry: dict[str, Any]) -> str:
    if entry["answer"] is not None:
        return entry["answer"]
    metadata = entry["metadata"]
    if dataset in EXAMPLE_IN_METADATA:
        example = metadata[EXAMPLE_IN_METADATA[dataset]]
        return example if isinstance(example, str) else json.dumps(example)
    if dataset == "rush_hour":
        return solve_rush_hour(metadata["board_config"])
    if dataset == "boxnet":
        return json.dumps(plan_boxnet(metadata["initial_state"]))
    raise AssertionError(f"no way to answer {dataset}")


def solve_rush_hour(config: str) -> str:
    """Fewest single steps that bring car A to the exit, as rush_hour's moves ("A+2 B-1").

    The question shows, and moves name, cars by their rank in the config's letters (a config with
    no E calls its F "E"), so the board is relabelled first.
    """
    cars = sorted(set(config) - {"o", "x"})
    board = config.translate({ord(car): ord("A") + rank for rank, car in enumerate(cars)})
    paths: dict[str, list[tuple[str, int]]] = {board: []}
    frontier = deque([board])
    while frontier:
        state = frontier.popleft()
        if state.index("A") == EXIT:
            return " ".join(f"{car}{step:+d}" for car, step in _runs(paths[state]))
        for car, step, following in _moves(state):
            if following not in paths:
                paths[following] = [*paths[state], (car, step)]
                frontier.append(following)
    raise AssertionError(f"rush_hour board {config} has no solution")


def _moves(state: str) -> list[tuple[str, int, str]]:
    moves = []
    for car in sorted(set(state) - {"o", "x"}):
        cells = [i for i, label in enumerate(state) if label == car]
        stride = cells[1] - cells[0]
        for step in (-1, 1):
            head = cells[0] - stride if step < 0 else cells[-1] + stride
            same_row = head // BOARD == cells[0] // BOARD
            if 0 <= head < len(state) and state[head] == "o" and (stride != 1 or same_row):
                tail = cells[-1] if step < 0 else cells[0]
                following = list(state)
                following[head], following[tail] = car, "o"
                moves.append((car, step, "".join(following)))
    return moves


def _runs(steps: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Consecutive steps of one car in one direction joined into one move."""
    runs: list[tuple[str, int]] = []
    for car, step in steps:
        if runs and runs[-1][0] == car and (runs[-1][1] > 0) == (step > 0):
            runs[-1] = (car, runs[-1][1] + step)
        else:
            runs.append((car, step))
    return runs


def plan_boxnet(state: dict[str, list[str]]) -> list[dict[str, str]]:
    """One action per step: each box walked square by square (x first) to its colour's target."""
    where = {item: square for square, items in state.items() for item in items}
    plan = []
    for box in sorted(item for item in where if item.startswith("box_")):
        target = "target_" + box.removeprefix("box_")
        x, y = (float(part) for part in where[box].split("_"))
        goal_x, goal_y = (float(part) for part in where[target].split("_"))
        while (x, y) != (goal_x, goal_y):
            next_x = x + (goal_x > x) - (goal_x < x)
            next_y = y if next_x != x else y + (goal_y > y) - (goal_y < y)
            plan.append({f"Agent[{x}, {y}]": f"move({box}, square[{next_x}, {next_y}])"})
            x, y = next_x, next_y
        plan.append({f"Agent[{x}, {y}]": f"move({box}, {target})"})
    return plan
