"""BabyAI's high-level text actions compiled into minigrid's primitive moves by path planning.

The action list is AgentGym's: ``turn left``, ``turn right``, ``move forward``, ``go to <obj>
<id>``, ``pick up <obj> <id>``, ``go through <door> <id>``, ``toggle and go through <door> <id>``,
``toggle``, ``drop`` and ``check available actions``, where ``<obj> <id>`` is an object's label in
the current view ("red ball 1"). Each available action maps to the primitive moves that carry it
out; an action that names something in view but cannot be done now maps to the reason instead.

Paths are a breadth-first search over (cell, direction) states with minigrid's three moves
(forward first, then left, then right, as AgentGym searches), so a path is a shortest one in
primitive steps. The search runs over the *known* grid: the cells the agent has seen this
episode, which it may cross only where nothing blocks it (floor, open doors). Nothing in a BabyAI
level moves unless the agent moves it, and the agent only changes the cell in front of it, which
it always sees, so what it remembers of a cell is what is there.

Where AgentGym's own checks are loose this follows minigrid's rules instead: ``move forward``
is offered when the cell ahead can be entered (AgentGym only looks for walls and boxes),
``drop`` when the cell ahead is empty, and ``toggle`` also for a box in front (it holds a key in
KeyInBox, which AgentGym's list cannot open).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minigrid.core.actions import Actions
from minigrid.core.constants import DIR_TO_VEC
from minigrid.core.world_object import Door, Key, WorldObj

from env_server.envs.embodied.babyai_text import SeenObject, object_name

LEFT, RIGHT, FORWARD = int(Actions.left), int(Actions.right), int(Actions.forward)
PICKUP, DROP, TOGGLE, DONE = int(Actions.pickup), int(Actions.drop), int(Actions.toggle), int(Actions.done)

TURN_LEFT, TURN_RIGHT, MOVE_FORWARD = "turn left", "turn right", "move forward"
TOGGLE_ACTION, DROP_ACTION, CHECK = "toggle", "drop", "check available actions"

Cell = tuple[int, int]
State = tuple[Cell, int]


@dataclass(frozen=True, slots=True)
class Scene:
    """What the planner knows: the agent, the cell ahead, the objects in view, the walkable known cells."""

    agent_pos: Cell
    agent_dir: int
    carrying: WorldObj | None
    ahead: WorldObj | None
    objects: tuple[SeenObject, ...]
    walkable: frozenset[Cell]


@dataclass(frozen=True, slots=True)
class ActionTable:
    """Available actions (in list order) with their primitive moves, and refused ones with the reason."""

    moves: dict[str, list[int]]
    refusals: dict[str, str]


def _ahead(cell: Cell, direction: int) -> Cell:
    dx, dy = DIR_TO_VEC[direction]
    return cell[0] + int(dx), cell[1] + int(dy)


class PathPlanner:
    """One breadth-first search from the agent's state; paths to any target are read off it."""

    def __init__(self, walkable: frozenset[Cell], start: Cell, direction: int) -> None:
        begin: State = (start, direction)
        self._parents: dict[State, tuple[State, int] | None] = {begin: None}
        self._order: dict[State, int] = {begin: 0}
        queue = deque([begin])
        while queue:
            state = queue.popleft()
            cell, facing = state
            for action in (FORWARD, LEFT, RIGHT):
                if action == FORWARD:
                    successor = (_ahead(cell, facing), facing)
                    if successor[0] not in walkable:
                        continue
                else:
                    successor = (cell, (facing + (1 if action == RIGHT else -1)) % 4)
                if successor not in self._parents:
                    self._parents[successor] = (state, action)
                    self._order[successor] = len(self._order)
                    queue.append(successor)

    def facing(self, target: Cell) -> list[int] | None:
        """Moves that end next to ``target`` and facing it; None when no known path leads there."""
        candidates = []
        for direction in range(4):
            dx, dy = DIR_TO_VEC[direction]
            candidates.append(((target[0] - int(dx), target[1] - int(dy)), direction))
        return self._path(candidates)

    def onto(self, target: Cell) -> list[int] | None:
        """Moves that end standing on ``target`` (an open door), in any direction."""
        return self._path([(target, direction) for direction in range(4)])

    def _path(self, goals: list[State]) -> list[int] | None:
        reached = [goal for goal in goals if goal in self._order]
        if not reached:
            return None
        state = min(reached, key=self._order.__getitem__)  # the first one the search reached
        moves = []
        while (step := self._parents[state]) is not None:
            state, action = step
            moves.append(action)
        return moves[::-1]


def _key_fits(carrying: WorldObj | None, door: WorldObj) -> str | None:
    """Why ``carrying`` cannot unlock ``door``, or None when it can."""
    if not isinstance(carrying, Key):
        return "as you are not carrying a key"
    if carrying.color != door.color:
        return "as the color of the key you are carrying does not match the color of door"
    return None


def compile_actions(scene: Scene) -> ActionTable:
    """Every action that can be done now with its moves, and every one that names a seen thing but cannot."""
    planner = PathPlanner(scene.walkable, scene.agent_pos, scene.agent_dir)
    moves: dict[str, list[int]] = {TURN_LEFT: [LEFT], TURN_RIGHT: [RIGHT]}
    refusals: dict[str, str] = {}
    no_path = ", as there is no path leading to it."

    if scene.ahead is None or scene.ahead.can_overlap():
        moves[MOVE_FORWARD] = [FORWARD]
    else:
        refusals[MOVE_FORWARD] = "There is a barrier in front of you, you can't move forward."

    for seen in scene.objects:
        if not seen.obj.can_pickup():
            continue
        action = f"pick up {seen.label}"
        if scene.carrying is not None:
            refusals[action] = f"You cannot pick up {seen.label}, as you are already carrying something."
        elif (path := planner.facing(seen.position)) is None:
            refusals[action] = f"You cannot pick up {seen.label}{no_path}"
        else:
            moves[action] = [*path, PICKUP]

    if scene.carrying is None:
        refusals[DROP_ACTION] = "You cannot drop the object, as you are not carrying anything."
    elif scene.ahead is not None:
        refusals[DROP_ACTION] = "You cannot drop the object, as there is already an object in front of you."
    else:
        moves[DROP_ACTION] = [DROP]

    for seen in scene.objects:
        if isinstance(seen.obj, Door):
            _door_actions(seen, scene, planner, moves, refusals)

    if (why_not := _toggle_refusal(scene)) is None:
        moves[TOGGLE_ACTION] = [TOGGLE]
    else:
        refusals[TOGGLE_ACTION] = why_not

    for seen in scene.objects:
        action = f"go to {seen.label}"
        path = planner.facing(seen.position)
        if path is None:
            refusals[action] = f"You cannot go to {seen.label}{no_path}"
        else:
            # Already facing it: minigrid checks a goal only when a step is taken, so arriving
            # is confirmed with its no-op move.
            moves[action] = path or [DONE]

    moves[CHECK] = []
    return ActionTable(moves, refusals)


def _door_actions(
    seen: SeenObject,
    scene: Scene,
    planner: PathPlanner,
    moves: dict[str, list[int]],
    refusals: dict[str, str],
) -> None:
    door = seen.obj
    through, toggle_through = f"go through {seen.label}", f"toggle and go through {seen.label}"
    no_path = ", as there is no path leading to it."
    if door.is_open:
        path = planner.onto(seen.position)
        if path:
            moves[through] = path
        elif path is None:
            refusals[through] = f"You cannot go through {seen.label}{no_path}"
        else:
            refusals[through] = f"You cannot go through {seen.label}, as you are already in it."
        return
    state = "locked" if door.is_locked else "closed"
    refusals[through] = f"You cannot go through {seen.label}, as it is {state}. You should toggle it first."
    if door.is_locked and (why_not := _key_fits(scene.carrying, door)) is not None:
        refusals[toggle_through] = f"You cannot toggle and go through {seen.label}, {why_not}."
    elif (path := planner.facing(seen.position)) is None:
        refusals[toggle_through] = f"You cannot toggle and go through {seen.label}{no_path}"
    else:
        moves[toggle_through] = [*path, TOGGLE, FORWARD]


def _toggle_refusal(scene: Scene) -> str | None:
    """Why ``toggle`` does nothing useful now, or None: a closed door, a box, or a door the key opens."""
    ahead = scene.ahead
    if isinstance(ahead, Door) and not ahead.is_open:
        if ahead.is_locked and (why_not := _key_fits(scene.carrying, ahead)) is not None:
            return f"You cannot toggle the {object_name(ahead)} in front of you, {why_not}."
        return None
    if ahead is not None and ahead.type == "box":
        return None
    return "There is no closed door or box right in front of you to toggle."
