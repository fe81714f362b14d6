"""Sokoban in-process: generation (solvable, unsolved, deterministic), the reward rules, the text."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError
from solvers import find, parse_grid, solve_sokoban

from env_server.envs.game.sokoban import SokobanEnv, SokobanOptions, parse_room

ACTIONS = ["Up", "Left", "Down", "Right", "Right", "Down", "Up", "Left", "hop", "Down", "Right"]


def new_env(seed: int, **options) -> tuple[SokobanEnv, str]:
    env = SokobanEnv()
    return env, env.reset(seed, SokobanOptions(**options)).observation


def outcomes(seed: int, actions: list[str], **options) -> list[tuple]:
    env, first = new_env(seed, **options)
    trace: list[tuple] = [first]
    for action in actions:
        step = env.step(action)
        trace.append((step.observation, step.reward, step.done, step.info))
        if step.done:
            break
    return trace


def room_env(grid: str) -> SokobanEnv:
    env = SokobanEnv()
    env.reset_to(parse_room(grid))
    return env


@pytest.mark.parametrize("options", [{}, {"num_boxes": 2, "dim": [7, 7]}])
def test_same_seed_gives_the_same_episode(options: dict) -> None:
    for seed in range(20):
        assert outcomes(seed, ACTIONS, **options) == outcomes(seed, ACTIONS, **options)


def test_generation_leaves_the_global_rng_alone() -> None:
    state = random.getstate()
    new_env(3, num_boxes=2, dim=[7, 7])
    assert random.getstate() == state


def test_different_seeds_give_different_rooms() -> None:
    rooms = {new_env(seed)[1] for seed in range(50)}
    assert len(rooms) > 40


@pytest.mark.parametrize(
    ("options", "seeds"),
    [({}, range(300)), ({"num_boxes": 2, "dim": [7, 7]}, range(40)), ({"dim": [5, 8]}, range(40))],
)
def test_generated_rooms_are_solvable_and_not_solved(options: dict, seeds: range) -> None:
    parsed = SokobanOptions(**options)
    for seed in seeds:
        _, observation = new_env(seed, **options)
        grid = parse_grid(observation)
        assert (len(grid), len(grid[0])) == parsed.dim
        assert all(
            symbol == "#"
            for symbol in grid[0] + grid[-1] + [row[0] for row in grid] + [row[-1] for row in grid]
        )
        assert len(find(grid, "X√")) == len(find(grid, "O√S")) == parsed.num_boxes
        assert len(find(grid, "PS")) == 1
        assert find(grid, "X"), f"seed {seed}: generated already solved"
        plan = solve_sokoban(observation)
        assert plan, f"seed {seed}: unsolvable room\n{observation}"


@pytest.mark.parametrize(
    "options",
    [
        {"dim": [4, 6]},
        {"dim": [6, 13]},
        {"dim": [6]},
        {"dim": [6, 6, 6]},
        {"num_boxes": 0},
        {"num_boxes": 5},
        {"dim": [5, 5], "num_boxes": 3},
        {"max_generation_tries": 0},
        {"boxes": 1},
    ],
)
def test_bad_options_are_rejected(options: dict) -> None:
    with pytest.raises(ValidationError):
        SokobanOptions(**options)


def test_dim_accepts_a_json_list() -> None:
    assert SokobanOptions.model_validate({"dim": [7, 9], "num_boxes": 2}).dim == (7, 9)


def test_a_plain_step_costs_a_tenth() -> None:
    env = room_env("# # # # #\n# P _ _ #\n# _ X O #\n# # # # #")
    step = env.step("Right")
    assert step.reward == pytest.approx(-0.1)
    assert (step.done, step.info) == (False, {"valid": True, "boxes_on_target": 0})
    assert parse_grid(step.observation) == parse_grid("# # # # #\n# _ P _ #\n# _ X O #\n# # # # #")


@pytest.mark.parametrize(
    ("grid", "action"),
    [
        ("# # # # #\n# P _ _ #\n# _ X O #\n# # # # #", "Up"),  # wall
        ("# # # # # #\n# _ P X # #\n# _ _ O _ #\n# # # # # #", "Right"),  # box against a wall
        ("# # # # # # #\n# P X X _ O #\n# _ _ _ _ O #\n# # # # # # #", "Right"),  # box against a box
    ],
)
def test_a_blocked_move_is_a_valid_step_that_changes_nothing(grid: str, action: str) -> None:
    env = room_env(grid)
    step = env.step(action)
    assert step.reward == pytest.approx(-0.1)
    assert not step.done and step.info["valid"]
    assert parse_grid(step.observation) == parse_grid(grid)


def test_pushing_a_box_onto_a_target_earns_one() -> None:
    env = room_env("# # # # # #\n# P X O _ #\n# _ X _ O #\n# # # # # #")
    step = env.step("Right")
    assert step.reward == pytest.approx(-0.1 + 1)
    assert (step.done, step.info) == (False, {"valid": True, "boxes_on_target": 1})
    assert parse_grid(step.observation)[1] == ["#", "_", "P", "√", "_", "#"]


def test_pushing_a_box_off_a_target_costs_one() -> None:
    env = room_env("# # # # # #\n# P √ _ _ #\n# _ X _ O #\n# # # # # #")
    step = env.step("Right")
    assert step.reward == pytest.approx(-0.1 - 1)
    assert (step.done, step.info) == (False, {"valid": True, "boxes_on_target": 0})
    assert parse_grid(step.observation)[1] == ["#", "_", "S", "X", "_", "#"]


def test_pushing_a_box_from_target_to_target_only_costs_the_step() -> None:
    env = room_env("# # # # # #\n# P √ O _ #\n# _ X _ _ #\n# # # # # #")
    step = env.step("Right")
    assert step.reward == pytest.approx(-0.1)
    assert step.info["boxes_on_target"] == 1


def test_solving_the_room_earns_ten_and_ends_the_episode() -> None:
    env = room_env("# # # # # #\n# P X O _ #\n# # # # # #")
    step = env.step("Right")
    assert step.reward == pytest.approx(-0.1 + 1 + 10)
    assert step.done
    assert step.info == {"valid": True, "success": True, "boxes_on_target": 1}
    assert step.observation.endswith("All boxes are on targets.")


@pytest.mark.parametrize("action", ["jump", "", "Upp", "up up", "Up || Left", "5"])
def test_an_invalid_action_moves_nothing_and_costs_the_step_penalty(action: str) -> None:
    grid = "# # # # #\n# P _ _ #\n# _ X O #\n# # # # #"
    env = room_env(grid)
    step = env.step(action)
    assert step.reward == pytest.approx(-0.1)
    assert (step.done, step.info) == (False, {"valid": False, "boxes_on_target": 0})
    assert parse_grid(step.observation) == parse_grid(grid)
    assert "Invalid action" in step.observation


@pytest.mark.parametrize("spelling", ["right", "RIGHT", " Right ", "Right.", "'Right'", '"right"'])
def test_actions_are_case_insensitive_and_tolerate_punctuation(spelling: str) -> None:
    env = room_env("# # # # #\n# P _ _ #\n# _ X O #\n# # # # #")
    step = env.step(spelling)
    assert step.info["valid"]
    assert find(parse_grid(step.observation), "P") == [(1, 2)]


def test_playing_a_solution_earns_the_rule_arithmetic() -> None:
    for seed in range(30):
        env = SokobanEnv()
        first = env.reset(seed, SokobanOptions(num_boxes=2, dim=(7, 7)))
        plan = solve_sokoban(first.observation)
        assert plan
        steps = [env.step(action) for action in plan]
        assert [step.done for step in steps] == [False] * (len(plan) - 1) + [True]
        assert steps[-1].info["success"]
        expected = -0.1 * len(plan) + (2 - first.info["boxes_on_target"]) + 10
        assert sum(step.reward for step in steps) == pytest.approx(expected)


def test_room_text_round_trips() -> None:
    grid = "# # # # # #\n# S X _ _ #\n# _ √ O X #\n# # # # # #"
    assert parse_room(grid).render() == grid
    assert parse_room(grid.replace(" ", "")).render() == grid


@pytest.mark.parametrize(
    "middle",
    [
        "# P X # #\n# _ _ #",  # ragged rows
        "# P X _ # #",  # no target
        "# P X O P #",  # two players
        "# P X X O #",  # more boxes than targets
        "# P X Z O #",  # unknown symbol
        "# P _ _ _ #",  # no box
        "_ P X O _ _",  # no wall around
    ],
)
def test_bad_rooms_are_refused(middle: str) -> None:
    with pytest.raises(ValueError):
        parse_room(f"# # # # # #\n{middle}\n# # # # # #")


def test_observation_is_plain_text_from_a_small_vocabulary() -> None:
    words = set()
    for seed in range(30):
        for observation, *_ in outcomes(seed, ACTIONS)[1:]:
            assert "\x1b" not in observation
            words.update(observation.split())
    assert len(words) <= 25, sorted(words)


def test_available_actions_are_the_four_directions() -> None:
    env, _ = new_env(0)
    assert env.available_actions() == ["Up", "Down", "Left", "Right"]
    for action in env.available_actions():
        assert env.step(action).info["valid"]
