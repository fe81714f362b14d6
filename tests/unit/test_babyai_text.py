"""BabyAI's text view on hand-made egocentric views: the sentences, their order and numbering, where objects are."""

from __future__ import annotations

import numpy as np
import pytest
from minigrid.core.grid import Grid
from minigrid.core.world_object import Ball, Box, Door, Key, Wall, WorldObj

from env_server.envs.embodied.babyai_text import describe, look, object_name

SIZE = 7
AGENT = (SIZE // 2, SIZE - 1)  # where minigrid puts the agent in its egocentric view, facing up
FACING_RIGHT, FACING_DOWN, FACING_LEFT, FACING_UP = range(4)


def view_of(cells: dict[tuple[int, int], WorldObj]) -> Grid:
    """A 7x7 egocentric view; keys are (steps to the right, steps in front)."""
    grid = Grid(SIZE, SIZE)
    for (right, front), obj in cells.items():
        grid.set(AGENT[0] + right, AGENT[1] - front, obj)
    return grid


def all_visible() -> np.ndarray:
    return np.ones((SIZE, SIZE), dtype=bool)


def text(cells: dict[tuple[int, int], WorldObj], carrying: WorldObj | None = None) -> str:
    seen = look(view_of(cells), all_visible(), (10, 10), FACING_UP, (30, 30))
    return describe(seen, carrying)


def test_the_issue_example_sentence() -> None:
    assert text({(1, 2): Ball("red")}) == (
        "In front of you in this room, you can see several objects: "
        "There is a red ball 1 2 steps in front of you and 1 steps to your right. "
        "The room has walls around you. You are not carrying anything."
    )


def test_positions_left_right_and_straight_ahead() -> None:
    described = text({(-2, 3): Key("green"), (0, 4): Box("purple"), (3, 0): Ball("blue")})
    assert "There is a green key 1 3 steps in front of you and 2 steps to your left." in described
    assert "There is a purple box 1 right in front of you 4 steps away." in described
    assert "There is a blue ball 1 0 steps in front of you and 3 steps to your right." in described


def test_nearest_first_numbered_per_name_and_doors_say_their_state() -> None:
    described = text(
        {
            (0, 5): Key("grey"),
            (1, 1): Key("grey"),
            (-1, 3): Door("yellow", is_locked=True),
            (2, 3): Door("blue"),
            (-3, 5): Door("green", is_open=True),
        }
    )
    assert described == (
        "In front of you in this room, you can see several objects: "
        "There is a grey key 1 1 steps in front of you and 1 steps to your right. "
        "There is a yellow locked door 1 3 steps in front of you and 1 steps to your left. "
        "There is a grey key 2 right in front of you 5 steps away. "
        "There is a blue closed door 1 3 steps in front of you and 2 steps to your right. "
        "There is a green open door 1 5 steps in front of you and 3 steps to your left. "
        "The room has walls around you. You are not carrying anything."
    )


def test_distance_ties_keep_agentgyms_scan_order_far_row_first_then_left_to_right() -> None:
    seen = look(
        view_of({(2, 0): Ball("red"), (-1, 1): Ball("red"), (1, 1): Ball("red"), (0, 2): Ball("red")}),
        all_visible(),
        (10, 10),
        FACING_UP,
        (30, 30),
    )
    assert [(o.label, o.front, o.right) for o in seen.objects] == [
        ("red ball 1", 2, 0),
        ("red ball 2", 1, -1),
        ("red ball 3", 1, 1),
        ("red ball 4", 0, 2),
    ]


def test_walls_are_not_listed_and_the_nearest_barrier_ahead_is() -> None:
    cells = {(0, 4): Wall(), (0, 2): Box("red"), (1, 1): Wall(), (-1, 1): Ball("grey")}
    described = text(cells)
    assert "wall 1" not in described
    assert described.endswith(
        "The room has walls around you. You are facing a box 2 steps away. You are not carrying anything."
    )
    assert "You are facing a wall 3 steps away." in text({(0, 3): Wall(), (0, 1): Ball("red")})


def test_nothing_in_sight_and_what_the_agent_carries() -> None:
    assert text({(1, 1): Wall()}, carrying=Key("blue")) == (
        "You cannot see any objects within sight. The room has walls around you. You are carrying a blue key."
    )


def test_hidden_cells_and_the_carried_object_in_the_agents_own_cell_are_not_described() -> None:
    view = view_of({(0, 0): Key("blue"), (1, 3): Ball("red"), (-1, 1): Ball("green")})
    visible = all_visible()
    visible[AGENT[0] + 1, AGENT[1] - 3] = False
    described = describe(look(view, visible, (10, 10), FACING_UP, (30, 30)), Key("blue"))
    assert "red ball" not in described and "blue key 1" not in described
    assert "There is a green ball 1 1 steps in front of you and 1 steps to your left." in described


@pytest.mark.parametrize(
    ("direction", "expected"),
    [(FACING_RIGHT, (12, 11)), (FACING_DOWN, (9, 12)), (FACING_LEFT, (8, 9)), (FACING_UP, (11, 8))],
)
def test_world_positions_turn_with_the_agent(direction: int, expected: tuple[int, int]) -> None:
    seen = look(view_of({(1, 2): Ball("red")}), all_visible(), (10, 10), direction, (30, 30))
    assert [o.position for o in seen.objects] == [expected]


def test_visible_cells_stay_inside_the_world() -> None:
    seen = look(view_of({}), all_visible(), (1, 1), FACING_UP, (5, 5))
    # Facing up from (1, 1): rows 1 and 0 are in the world, columns -2..4 clipped to 0..4.
    assert seen.visible_cells == {(x, y) for x in range(5) for y in (0, 1)}


def test_object_names() -> None:
    assert [object_name(o) for o in (Ball("red"), Box("grey"), Door("blue", is_open=True))] == [
        "red ball",
        "grey box",
        "blue open door",
    ]
