"""BFS solvers for the grid games, reading the state only from the observation text.

They parse the grid as an agent would see it, so a solved level proves both that the level is
solvable and that the text shows the real state. Shared by the unit and integration tests.
"""

from __future__ import annotations

from collections import deque

Tile = tuple[int, int]
MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def parse_grid(observation: str) -> list[list[str]]:
    """The grid lines of an observation: leading lines made only of single-symbol tokens."""
    grid = []
    for line in observation.splitlines():
        tokens = line.split()
        if not tokens or any(len(token) != 1 for token in tokens):
            break
        grid.append(tokens)
    if not grid or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError(f"no rectangular grid in observation:\n{observation}")
    return grid


def find(grid: list[list[str]], symbols: str) -> list[Tile]:
    return [(r, c) for r, row in enumerate(grid) for c, symbol in enumerate(row) if symbol in symbols]


def solve_frozenlake(observation: str) -> list[str] | None:
    """Shortest action list from P to G that never enters a hole O (edges clamp, as in gymnasium)."""
    grid = parse_grid(observation)
    (start,), (goal,) = find(grid, "P"), find(grid, "G")
    holes = set(find(grid, "O"))
    size_r, size_c = len(grid), len(grid[0])
    plans = {start: []}
    frontier = deque([start])
    while frontier:
        tile = frontier.popleft()
        if tile == goal:
            return plans[tile]
        for name, (d_row, d_col) in MOVES.items():
            moved = (min(max(tile[0] + d_row, 0), size_r - 1), min(max(tile[1] + d_col, 0), size_c - 1))
            if moved not in plans and moved not in holes:
                plans[moved] = [*plans[tile], name]
                frontier.append(moved)
    return None


def solve_sokoban(observation: str, max_states: int = 500_000) -> list[str] | None:
    """Shortest action list that puts every box on a target, by BFS over (player, boxes) states."""
    grid = parse_grid(observation)
    walls = set(find(grid, "#"))
    targets = frozenset(find(grid, "O√S"))
    (player,) = find(grid, "PS")
    start = (player, frozenset(find(grid, "X√")))
    parents: dict[tuple[Tile, frozenset[Tile]], tuple | None] = {start: None}
    frontier = deque([start])
    while frontier and len(parents) < max_states:
        state = frontier.popleft()
        if state[1] <= targets:
            return _plan(parents, state)
        for name, move in MOVES.items():
            after = _push(state, move, walls)
            if after is not None and after not in parents:
                parents[after] = (state, name)
                frontier.append(after)
    return None


def _push(
    state: tuple[Tile, frozenset[Tile]], move: Tile, walls: set[Tile]
) -> tuple[Tile, frozenset[Tile]] | None:
    """The state after one move, or None when a wall or a blocked box stops the player."""
    (row, col), boxes = state
    to = (row + move[0], col + move[1])
    if to in walls:
        return None
    if to not in boxes:
        return to, boxes
    beyond = (to[0] + move[0], to[1] + move[1])
    if beyond in walls or beyond in boxes:
        return None
    return to, (boxes - {to}) | {beyond}


def _plan(parents: dict, state: tuple) -> list[str]:
    actions = []
    while parents[state] is not None:
        state, name = parents[state]
        actions.append(name)
    return actions[::-1]
