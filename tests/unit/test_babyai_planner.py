"""BabyAI's high-level actions on hand-made minigrid worlds: paths, the action list, refusals, effects."""

from __future__ import annotations

import textwrap

import pytest
from minigrid.core.grid import Grid
from minigrid.core.mission import MissionSpace
from minigrid.core.world_object import Ball, Box, Door, Key, Wall, WorldObj
from minigrid.minigrid_env import MiniGridEnv

from env_server.envs.embodied.babyai import BabyAIEnv
from env_server.envs.embodied.babyai_planner import FORWARD, LEFT, RIGHT, PathPlanner

COLORS = {"r": "red", "g": "green", "b": "blue", "p": "purple", "y": "yellow", "e": "grey"}
AGENT_DIRS = {">>": 0, "vv": 1, "<<": 2, "^^": 3}
OBJECTS = {
    "B": Ball,
    "K": Key,
    "X": Box,
    "D": Door,
    "L": lambda color: Door(color, is_locked=True),
    "O": lambda color: Door(color, is_open=True),
}


class HandMade(MiniGridEnv):
    """A minigrid world from a layout of two-letter cells: ``##`` wall, ``..`` floor, ``^^ >> vv <<``
    the agent facing up/right/down/left, else a colour and a kind (``rB`` red ball, ``yL`` yellow
    locked door; B ball, K key, X box, D closed door, L locked door, O open door)."""

    def __init__(self, layout: str, carrying: WorldObj | None = None) -> None:
        self.rows = [line.split() for line in textwrap.dedent(layout).strip().splitlines()]
        super().__init__(
            mission_space=MissionSpace(mission_func=lambda: "explore"),
            width=len(self.rows[0]),
            height=len(self.rows),
            max_steps=100,
        )
        self.reset(seed=0)
        self.carrying = carrying

    def _gen_grid(self, width: int, height: int) -> None:
        self.grid = Grid(width, height)
        for y, row in enumerate(self.rows):
            for x, cell in enumerate(row):
                if cell == "##":
                    self.grid.set(x, y, Wall())
                elif cell in AGENT_DIRS:
                    self.agent_pos, self.agent_dir = (x, y), AGENT_DIRS[cell]
                elif cell != "..":
                    self.grid.set(x, y, OBJECTS[cell[1]](COLORS[cell[0]]))
        self.mission = "explore"


def start(layout: str, carrying: WorldObj | None = None) -> tuple[BabyAIEnv, HandMade, str]:
    env = BabyAIEnv()
    world = HandMade(layout, carrying)
    return env, world, env.reset_to(world).observation


ROOM = """
    ## ## ## ## ## ## ##
    ## .. .. .. .. .. ##
    ## .. rB .. .. .. ##
    ## .. .. eX .. .. ##
    ## .. .. .. .. .. ##
    ## .. .. ^^ .. .. ##
    ## ## ## ## ## ## ##
"""


def test_first_observation_lists_what_is_seen_and_the_actions_for_it() -> None:
    env, _, observation = start(ROOM)
    assert observation == (
        "Your goal: explore\n"
        "In front of you in this room, you can see several objects: "
        "There is a grey box 1 right in front of you 2 steps away. "
        "There is a red ball 1 3 steps in front of you and 1 steps to your left. "
        "The room has walls around you. You are facing a box 2 steps away. You are not carrying anything.\n"
        'Available actions: ["turn left", "turn right", "move forward", "pick up grey box 1", '
        '"pick up red ball 1", "go to grey box 1", "go to red ball 1", "check available actions"]'
    )
    assert env.available_actions() == [
        "turn left",
        "turn right",
        "move forward",
        "pick up grey box 1",
        "pick up red ball 1",
        "go to grey box 1",
        "go to red ball 1",
        "check available actions",
    ]


def test_go_to_walks_a_shortest_path_and_ends_facing_the_object() -> None:
    env, world, _ = start(ROOM)
    step = env.step("go to red ball 1")
    assert step.info == {"valid": True} and not step.done
    # From (3, 5) facing up, the box at (3, 3) is in the way: forward, left, forward, right,
    # forward ends at (2, 3) facing the ball at (2, 2).
    assert (tuple(world.agent_pos), world.agent_dir, world.step_count) == ((2, 3), 3, 5)
    assert "There is a red ball 1 right in front of you 1 steps away." in step.observation


def test_go_to_when_already_facing_the_object_takes_minigrids_no_op_step() -> None:
    env, world, _ = start(ROOM)
    env.step("move forward")
    assert env.step("go to grey box 1").info == {"valid": True}
    assert (tuple(world.agent_pos), world.step_count) == ((3, 4), 2)


def test_pick_up_then_drop() -> None:
    env, world, _ = start(ROOM)
    picked = env.step("pick up red ball 1")
    assert picked.info["valid"] and world.carrying is not None and world.carrying.color == "red"
    assert picked.observation.split("\n")[0].endswith("You are carrying a red ball.")
    refused = env.step("pick up grey box 1")
    assert refused.info == {"valid": False}
    assert refused.observation.startswith(
        "You cannot pick up grey box 1, as you are already carrying something.\nAvailable actions: ["
    )
    env.step("turn left")
    dropped = env.step("drop")
    assert dropped.info["valid"] and world.carrying is None
    assert world.grid.get(1, 3).type == "ball"


def test_moves_into_blocked_cells_and_drops_onto_objects_are_refused_without_a_step() -> None:
    env, world, _ = start(ROOM)
    env.step("move forward")
    blocked = env.step("move forward")
    assert blocked.info == {"valid": False}
    assert blocked.observation.startswith("There is a barrier in front of you, you can't move forward.")
    assert env.step("drop").observation.startswith(
        "You cannot drop the object, as you are not carrying anything."
    )
    assert world.step_count == 1


DOORS = """
    ## ## ## ## ## ## ##
    ## .. .. .. .. .. ##
    ## ## yL ## bD ## ##
    ## .. .. .. .. .. ##
    ## .. .. ^^ .. .. ##
    ## ## ## ## ## ## ##
"""


def test_locked_doors_need_a_key_of_their_colour() -> None:
    env, _, observation = start(DOORS)
    assert "There is a yellow locked door 1 2 steps in front of you and 1 steps to your left." in observation
    assert "toggle and go through yellow locked door 1" not in env.available_actions()
    assert env.step("toggle and go through yellow locked door 1").observation.startswith(
        "You cannot toggle and go through yellow locked door 1, as you are not carrying a key."
    )
    env, _, _ = start(DOORS, carrying=Key("red"))
    assert env.step("toggle and go through yellow locked door 1").observation.startswith(
        "You cannot toggle and go through yellow locked door 1, as the color of the key you are "
        "carrying does not match the color of door."
    )


def test_toggle_and_go_through_a_locked_door_with_its_key() -> None:
    env, world, _ = start(DOORS, carrying=Key("yellow"))
    step = env.step("toggle and go through yellow locked door 1")
    assert step.info == {"valid": True}
    door = world.grid.get(2, 2)
    assert door.is_open and not door.is_locked and tuple(world.agent_pos) == (2, 2)
    assert "go through yellow open door 1" not in env.available_actions()


def test_closed_doors_are_toggled_before_going_through_and_open_ones_are_walked_into() -> None:
    env, world, _ = start(DOORS)
    assert env.step("go through blue closed door 1").observation.startswith(
        "You cannot go through blue closed door 1, as it is closed. You should toggle it first."
    )
    assert env.step("toggle").info == {"valid": False}
    env.step("go to blue closed door 1")
    assert "toggle" in env.available_actions()
    assert env.step("toggle").info == {"valid": True} and world.grid.get(4, 2).is_open
    assert "go through blue open door 1" in env.available_actions()  # listed by its new name
    assert env.step("go through blue open door 1").info == {"valid": True}
    assert tuple(world.agent_pos) == (4, 2)


def test_toggle_opens_a_box_in_front() -> None:
    box = Box("green", contains=Key("green"))
    env, world, _ = start(ROOM)
    world.grid.set(3, 4, box)
    env.step("turn left")
    env.step("turn right")
    assert env.step("toggle").info == {"valid": True}
    assert world.grid.get(3, 4).type == "key"


def test_unknown_and_out_of_sight_actions_say_so() -> None:
    env, world, _ = start(ROOM)
    assert env.step("fly away").observation.startswith(
        "The action is not recognized. Please check valid actions.\nAvailable actions: ["
    )
    assert env.step("go to red ball 2").observation.startswith("There is no red ball 2 in sight.")
    assert world.step_count == 0


def test_spelling_is_forgiven_as_agentgym_spells_it() -> None:
    env, world, _ = start(ROOM)
    assert env.step("  Pickup   Red Ball 1. ").info == {"valid": True}
    assert world.carrying is not None


def test_check_available_actions_lists_them_and_takes_no_step() -> None:
    env, world, _ = start(ROOM)
    step = env.step("check available actions")
    assert step.info == {"valid": True} and world.step_count == 0
    assert step.observation.startswith(
        "You can take the following actions: turn left, turn right, move forward"
    )


def test_paths_cross_only_walkable_known_cells() -> None:
    # A corridor (1, 1) -> (3, 1) with the middle cell unknown: no path until it is known.
    corridor = frozenset({(1, 1), (3, 1)})
    assert PathPlanner(corridor, (1, 1), 0).facing((4, 1)) is None
    planner = PathPlanner(corridor | {(2, 1)}, (1, 1), 0)
    assert planner.facing((4, 1)) == [FORWARD, FORWARD]
    assert planner.onto((3, 1)) == [FORWARD, FORWARD]
    assert planner.facing((1, 0)) == [LEFT]
    assert PathPlanner(corridor | {(2, 1)}, (1, 1), 2).facing((4, 1)) == [LEFT, LEFT, FORWARD, FORWARD]
    assert planner.facing((2, 2)) is not None and planner.facing((2, 2))[-1] == RIGHT


@pytest.mark.parametrize("direction", range(4))
def test_path_lengths_are_shortest_in_primitive_moves(direction: int) -> None:
    open_room = frozenset((x, y) for x in range(1, 6) for y in range(1, 6))
    planner = PathPlanner(open_room, (3, 3), direction)
    for target in [(1, 1), (5, 5), (3, 6), (0, 3)]:
        path = planner.facing(target)
        assert path is not None
        assert len(path) == _brute_force_length(open_room, (3, 3), direction, target)


def _brute_force_length(walkable: frozenset, start: tuple, direction: int, target: tuple) -> int:
    """Shortest number of moves by iterative deepening over every move sequence (small rooms only)."""
    from itertools import product

    from minigrid.core.constants import DIR_TO_VEC

    for length in range(12):
        for moves in product((LEFT, RIGHT, FORWARD), repeat=length):
            (x, y), facing, ok = start, direction, True
            for move in moves:
                if move == FORWARD:
                    dx, dy = DIR_TO_VEC[facing]
                    if (x + dx, y + dy) not in walkable:
                        ok = False
                        break
                    x, y = x + dx, y + dy
                else:
                    facing = (facing + (1 if move == RIGHT else -1)) % 4
            dx, dy = DIR_TO_VEC[facing]
            if ok and (x + dx, y + dy) == target:
                return length
    raise AssertionError("no path")
