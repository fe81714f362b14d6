"""FrozenLake in-process: gymnasium's maps, determinism, rewards, invalid actions, the text."""

from __future__ import annotations

import random

import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from pydantic import ValidationError
from solvers import find, parse_grid, solve_frozenlake

from env_server.envs.game.frozenlake import FrozenLakeEnv, FrozenLakeOptions

SEEDS = range(40)


def new_env(seed: int, **options) -> tuple[FrozenLakeEnv, str]:
    env = FrozenLakeEnv()
    return env, env.reset(seed, FrozenLakeOptions(**options)).observation


def gymnasium_holes(size: int, seed: int) -> list[tuple[int, int]]:
    rows = generate_random_map(size, 0.8, seed)
    return [(r, c) for r, row in enumerate(rows) for c, tile in enumerate(row) if tile == "H"]


def outcomes(seed: int, actions: list[str], **options) -> list[tuple]:
    env, first = new_env(seed, **options)
    trace: list[tuple] = [first]
    for action in actions:
        step = env.step(action)
        trace.append((step.observation, step.reward, step.done, step.info))
        if step.done:
            break
    return trace


ACTIONS = ["Right", "Down", "Right", "Down", "Left", "Down", "Right", "Up"]


@pytest.mark.parametrize("options", [{}, {"slippery": True}, {"random_start_goal": True, "size": 6}])
def test_same_seed_gives_the_same_episode(options: dict) -> None:
    for seed in range(10):
        assert outcomes(seed, ACTIONS, **options) == outcomes(seed, ACTIONS, **options)


def test_instances_own_their_randomness() -> None:
    """Interleaved slippery episodes replay alone, and the global RNGs are left untouched."""
    alone = outcomes(5, ACTIONS, slippery=True)
    global_states = random.getstate(), np.random.get_state()[1].tobytes()
    twin, twin_first = new_env(5, slippery=True)
    other, _ = new_env(6, slippery=True)
    interleaved: list[tuple] = [twin_first]
    for action in ACTIONS[: len(alone) - 1]:
        other.step("Up")
        step = twin.step(action)
        interleaved.append((step.observation, step.reward, step.done, step.info))
    assert interleaved == alone
    assert (random.getstate(), np.random.get_state()[1].tobytes()) == global_states


def test_different_seeds_give_different_maps() -> None:
    maps = {new_env(seed)[1] for seed in SEEDS}
    assert len(maps) > len(SEEDS) // 2


@pytest.mark.parametrize("size", [4, 6])
def test_map_is_gymnasiums_for_the_seed(size: int) -> None:
    for seed in SEEDS:
        grid = parse_grid(new_env(seed, size=size)[1])
        assert find(grid, "O") == gymnasium_holes(size, seed)
        assert find(grid, "P") == [(0, 0)]
        assert find(grid, "G") == [(size - 1, size - 1)]


@pytest.mark.parametrize(
    "options",
    [{"size": 1}, {"size": 11}, {"p": 0.3}, {"p": 1.5}, {"slippery": "sometimes"}, {"holes": 3}],
)
def test_bad_options_are_rejected(options: dict) -> None:
    with pytest.raises(ValidationError):
        FrozenLakeOptions(**options)


@pytest.mark.parametrize("options", [{}, {"size": 6}, {"random_start_goal": True}, {"size": 8, "p": 0.7}])
def test_shortest_path_reaches_the_goal_for_reward_one(options: dict) -> None:
    for seed in SEEDS:
        env, observation = new_env(seed, **options)
        plan = solve_frozenlake(observation)
        assert plan, f"seed {seed}: no path to the goal"
        for action in plan[:-1]:
            step = env.step(action)
            assert (step.reward, step.done, step.info) == (0.0, False, {"valid": True})
        last = env.step(plan[-1])
        assert (last.reward, last.done, last.info) == (1.0, True, {"valid": True, "success": True})
        assert find(parse_grid(last.observation), "√") and not find(parse_grid(last.observation), "PG")
        assert last.observation.endswith("You reached the goal.")


def test_walking_into_a_hole_ends_the_episode_without_reward() -> None:
    checked = 0
    for seed in range(200):
        env, observation = new_env(seed)
        holes = find(parse_grid(observation), "O")
        action = "Right" if (0, 1) in holes else "Down" if (1, 0) in holes else None
        if action is None:
            continue
        step = env.step(action)
        assert (step.reward, step.done, step.info) == (0.0, True, {"valid": True, "success": False})
        assert find(parse_grid(step.observation), "X") and not find(parse_grid(step.observation), "P")
        assert step.observation.endswith("You fell into a hole.")
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("action", ["jump", "", "Leftt", "go left", "4", "Left || Up"])
def test_invalid_action_changes_nothing_and_does_not_end_the_episode(action: str) -> None:
    env, observation = new_env(3)
    step = env.step(action)
    assert (step.reward, step.done, step.info) == (0.0, False, {"valid": False})
    assert parse_grid(step.observation) == parse_grid(observation)
    assert "Invalid action" in step.observation
    assert env.step("Right").info["valid"]


@pytest.mark.parametrize("spelling", ["right", "RIGHT", " Right ", "Right.", "'Right'", '"right"'])
def test_actions_are_case_insensitive_and_tolerate_punctuation(spelling: str) -> None:
    env, _ = new_env(0, p=1.0)
    step = env.step(spelling)
    assert step.info["valid"]
    assert find(parse_grid(step.observation), "P") == [(0, 1)]


def test_moving_into_the_edge_is_a_valid_move_that_stays_in_place() -> None:
    env, observation = new_env(0, p=1.0)
    for action in ("Up", "Left"):
        step = env.step(action)
        assert step.info == {"valid": True} and not step.done
        assert parse_grid(step.observation) == parse_grid(observation)


def test_slippery_moves_go_sideways_sometimes_and_never_backwards() -> None:
    moves = set()
    for seed in range(40):
        env, observation = new_env(seed, p=1.0, size=10, slippery=True, random_start_goal=True)
        before = find(parse_grid(observation), "P")[0]
        if not all(0 < x < 9 for x in before):
            continue  # at the edge a blocked move stays in place and hides its direction
        step = env.step("Down")
        after = find(parse_grid(step.observation), "P√")[0]
        moves.add((after[0] - before[0], after[1] - before[1]))
    assert moves == {(1, 0), (0, 1), (0, -1)}, "down, or perpendicular to it; never up or staying"


def test_random_start_goal_places_a_reachable_goal_away_from_the_corners() -> None:
    corners = 0
    starts = set()
    for seed in range(100):
        _, observation = new_env(seed, size=5, random_start_goal=True)
        grid = parse_grid(observation)
        (start,), (goal,) = find(grid, "P"), find(grid, "G")
        assert start != goal
        assert solve_frozenlake(observation), f"seed {seed}: goal unreachable"
        assert find(grid, "O") == gymnasium_holes(5, seed)
        starts.add(start)
        corners += (start, goal) == ((0, 0), (4, 4))
    assert corners < 10 and len(starts) > 10


def test_observation_is_plain_text_from_a_small_vocabulary() -> None:
    words = set()
    for seed in range(30):
        for options in ({}, {"random_start_goal": True}):
            for observation, *_ in outcomes(seed, [*ACTIONS, "dance"], **options)[1:]:
                assert "\x1b" not in observation
                words.update(observation.split())
    assert "\x1b" not in new_env(0)[1]
    assert len(words) <= 30, sorted(words)


def test_available_actions_are_the_four_directions() -> None:
    env, _ = new_env(0)
    assert env.available_actions() == ["Left", "Down", "Right", "Up"]
    for action in env.available_actions():
        assert env.step(action).info["valid"]
