"""BabyAI's text view: what the agent sees in its 7x7 egocentric view, in AgentGym's words.

minigrid renders no text, so this module writes it from the partially observable view
(``MiniGridEnv.gen_obs_grid``: the agent at the bottom middle, facing up, cells hidden behind
walls and closed doors masked out). The sentences follow AgentGym's BabyAI server, which
AgentGym-RL's models were trained on: "In front of you in this room, you can see several objects:
There is a red ball 1 2 steps in front of you and 1 steps to your right. The room has walls
around you. You are facing a wall 3 steps away. You are not carrying anything."

Objects are listed nearest first (steps forward plus steps sideways), ties in AgentGym's scan
order (the far row first, then left to right), and numbered per name in that order ("grey key 1",
"grey key 2"): the number is how an action names an object. Walls are not listed; the nearest
wall or box straight ahead is the barrier sentence, as in AgentGym.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from minigrid.core.constants import DIR_TO_VEC
from minigrid.core.grid import Grid
from minigrid.core.world_object import Door, WorldObj

LISTED_TYPES = frozenset({"door", "key", "ball", "box", "goal", "lava"})
BARRIER_TYPES = frozenset({"wall", "box"})

SEES_OBJECTS = "In front of you in this room, you can see several objects:"
SEES_NOTHING = "You cannot see any objects within sight."
WALLS = "The room has walls around you."
EMPTY_HANDED = "You are not carrying anything."


@dataclass(frozen=True, slots=True)
class SeenObject:
    """An object in view, where it is relative to the agent and on the grid."""

    obj: WorldObj
    name: str
    number: int
    front: int
    right: int
    position: tuple[int, int]

    @property
    def label(self) -> str:
        """How actions name it: ``"red ball 1"``."""
        return f"{self.name} {self.number}"


@dataclass(frozen=True, slots=True)
class View:
    """One look through the agent's eyes: objects nearest first, the barrier ahead, the cells seen."""

    objects: tuple[SeenObject, ...]
    barrier: tuple[str, int] | None
    visible_cells: frozenset[tuple[int, int]]


def object_name(obj: WorldObj) -> str:
    """``"red ball"``; a door also says its state: ``"blue locked door"``, ``"green open door"``."""
    if isinstance(obj, Door):
        state = "open" if obj.is_open else "locked" if obj.is_locked else "closed"
        return f"{obj.color} {state} door"
    return f"{obj.color} {obj.type}"


def look(
    view: Grid, visible: np.ndarray, agent_pos: tuple[int, int], agent_dir: int, world_size: tuple[int, int]
) -> View:
    """Read an egocentric ``view`` (and its visibility mask) as seen from ``agent_pos``/``agent_dir``.

    ``world_size`` (width, height) bounds the visible cells: a view reaching past the grid's edge
    shows walls there that are not cells of the world.
    """
    size = view.width
    forward = DIR_TO_VEC[agent_dir]
    rightward = np.array((-forward[1], forward[0]))
    found: list[tuple[WorldObj, int, int, tuple[int, int]]] = []
    cells = set()
    for j in range(size):  # the far row first: AgentGym's scan order breaks distance ties
        for i in range(size):
            if not visible[i, j]:
                continue
            front, right = size - 1 - j, i - size // 2
            x, y = (int(c) for c in np.asarray(agent_pos) + front * forward + right * rightward)
            if 0 <= x < world_size[0] and 0 <= y < world_size[1]:
                cells.add((x, y))
            obj = view.get(i, j)
            if (front, right) != (0, 0) and obj is not None and obj.type in LISTED_TYPES:
                found.append((obj, front, right, (x, y)))
    found.sort(key=lambda item: item[1] + abs(item[2]))
    counts: Counter[str] = Counter()
    objects = []
    for obj, front, right, position in found:
        name = object_name(obj)
        counts[name] += 1
        objects.append(SeenObject(obj, name, counts[name], front, right, position))
    return View(tuple(objects), facing_barrier(view, visible), frozenset(cells))


def facing_barrier(view: Grid, visible: np.ndarray) -> tuple[str, int] | None:
    """The nearest visible wall or box straight ahead and how many steps away it is."""
    size, column = view.height, view.width // 2
    for front in range(1, size):
        j = size - 1 - front
        obj = view.get(column, j)
        if visible[column, j] and obj is not None and obj.type in BARRIER_TYPES:
            return obj.type, front
    return None


def position_phrase(front: int, right: int) -> str:
    if right == 0:
        return f"right in front of you {front} steps away."
    side = "right" if right > 0 else "left"
    return f"{front} steps in front of you and {abs(right)} steps to your {side}."


def describe(view: View, carrying: WorldObj | None) -> str:
    """The observation sentence block: objects in view, the walls, the barrier ahead, the hands."""
    if view.objects:
        parts = [SEES_OBJECTS]
        parts += [f"There is a {o.label} {position_phrase(o.front, o.right)}" for o in view.objects]
    else:
        parts = [SEES_NOTHING]
    parts.append(WALLS)
    if view.barrier is not None:
        kind, steps = view.barrier
        parts.append(f"You are facing a {kind} {steps} steps away.")
    parts.append(f"You are carrying a {object_name(carrying)}." if carrying is not None else EMPTY_HANDED)
    return " ".join(parts)
