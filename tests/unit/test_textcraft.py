"""TextCraft in-process: determinism (also across threads), every goal solvable, rewards, invalid actions."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError
from textcraft_planner import parse_task, plan

from env_server.envs.game.textcraft import (
    BOOK,
    DEEPEST_GOAL,
    MAX_DISTRACTORS,
    TextCraftEnv,
    TextCraftOptions,
)

SEEDS = range(30)


def new_env(seed: int, **options) -> tuple[TextCraftEnv, str]:
    env = TextCraftEnv()
    return env, env.reset(seed, TextCraftOptions(**options)).observation


def seed_for(item_id: str) -> int:
    """The seed whose goal is ``item_id`` when every depth is allowed (``min_depth=1``)."""
    return [goal.item_id for goal in BOOK.goals_between(1, None)].index(item_id)


def crafting_table() -> TextCraftEnv:
    """A task whose recipes these tests know: crafting table from 4 planks, planks from logs."""
    env, _ = new_env(seed_for("minecraft:crafting_table"), min_depth=1)
    return env


def test_metadata() -> None:
    assert TextCraftEnv.env_id() == "game/textcraft"
    assert TextCraftEnv.reward_range == (0.0, 1.0)
    assert TextCraftEnv().available_actions() is None
    assert BOOK.goals[0].depth == DEEPEST_GOAL, "the options' bound matches the data"


@pytest.mark.parametrize("seed", SEEDS)
def test_same_seed_same_task_also_after_other_resets(seed: int) -> None:
    env, first = new_env(seed)
    _, again = new_env(seed)
    assert first == again
    env.reset(seed + 1, TextCraftOptions())
    # The package's own reset mutates its shared tree, so there a second reset differs.
    assert env.reset(seed, TextCraftOptions()).observation == first


def test_resets_leave_the_shared_recipe_tree_untouched() -> None:
    sizes = {item: len(recipes) for item, recipes in BOOK.tree.itemid_recipes.items()}
    env = TextCraftEnv()
    for seed in range(200):
        env.reset(seed, TextCraftOptions(min_depth=1))
    assert {item: len(recipes) for item, recipes in BOOK.tree.itemid_recipes.items()} == sizes


def test_resets_from_many_threads_at_once_give_identical_tasks() -> None:
    seeds = [seed % 8 for seed in range(64)]
    expected = {seed: new_env(seed)[1] for seed in set(seeds)}
    barrier = threading.Barrier(len(seeds))

    def reset(seed: int) -> str:
        env = TextCraftEnv()
        barrier.wait()
        return env.reset(seed, TextCraftOptions()).observation

    with ThreadPoolExecutor(len(seeds)) as pool:
        observed = list(pool.map(reset, seeds))
    assert observed == [expected[seed] for seed in seeds]


def test_tasks_do_not_depend_on_the_process_hash_seed() -> None:
    """The package orders recipes by set iteration, which changes from one process to the next."""
    script = (
        "from env_server.envs.game.textcraft import TextCraftEnv, TextCraftOptions\n"
        "env = TextCraftEnv()\n"
        "for seed in range(50):\n"
        "    print(env.reset(seed, TextCraftOptions()).observation)\n"
    )

    def tasks(hash_seed: str) -> str:
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout

    assert tasks("1") == tasks("2") == "".join(new_env(seed)[1] + "\n" for seed in range(50))


def test_seeds_walk_through_every_goal_deepest_first() -> None:
    goals = BOOK.goals_between(1, None)
    infos = [TextCraftEnv().reset(seed, TextCraftOptions(min_depth=1)).info for seed in range(len(goals))]
    assert len({info["goal"] for info in infos}) == len(goals)
    depths = [info["depth"] for info in infos]
    assert depths == sorted(depths, reverse=True)
    assert TextCraftEnv().reset(len(goals), TextCraftOptions(min_depth=1)).info == infos[0]


@pytest.mark.parametrize(("min_depth", "max_depth"), [(1, 1), (2, 2), (3, None), (4, 4), (1, 3)])
def test_depth_options_bound_the_goal(min_depth: int, max_depth: int | None) -> None:
    for seed in SEEDS:
        depth = (
            TextCraftEnv()
            .reset(seed, TextCraftOptions(min_depth=min_depth, max_depth=max_depth))
            .info["depth"]
        )
        assert min_depth <= depth <= (max_depth or depth)


@pytest.mark.parametrize(
    "options", [{"min_depth": 0}, {"min_depth": 5}, {"min_depth": 3, "max_depth": 2}, {"goal": "stick"}]
)
def test_bad_options_are_refused(options: dict) -> None:
    with pytest.raises(ValidationError):
        TextCraftOptions(**options)


@pytest.mark.parametrize("seed", SEEDS)
def test_observation_lists_the_needed_recipes_and_a_few_distractors(seed: int) -> None:
    env, observation = new_env(seed)
    goal, recipes = parse_task(observation)
    assert goal == env.reset(seed, TextCraftOptions()).info["goal"]
    needed, _ = BOOK.tasks[f"minecraft:{goal.replace(' ', '_')}"]
    shown = observation.split("\n\n")[0].splitlines()[1:]
    assert set(needed) <= set(shown)
    assert len(shown) == len(recipes) == len(set(shown)) <= len(needed) + MAX_DISTRACTORS


def test_the_planner_crafts_every_goal_from_the_text_alone() -> None:
    """Every goal in the data is solvable, and only its last action earns the reward."""
    for seed in range(len(BOOK.goals)):
        env, observation = new_env(seed, min_depth=1)
        actions = plan(observation)
        steps = [env.step(action) for action in actions]
        assert all(step.info["valid"] and "failure" not in step.info for step in steps), (seed, steps)
        assert [step.reward for step in steps] == [0.0] * (len(steps) - 1) + [1.0], (seed, actions)
        assert [step.done for step in steps] == [False] * (len(steps) - 1) + [True]
        assert steps[-1].info["success"] is True


def test_crafting_table_walkthrough() -> None:
    env = crafting_table()
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."
    assert env.step("get 1 oak logs").observation == "Got 1 oak logs"
    crafted = env.step("craft 4 oak planks using 1 oak logs")
    assert (crafted.observation, crafted.reward, crafted.done) == (
        "Crafted 4 minecraft:oak_planks",
        0.0,
        False,
    )
    assert env.step("inventory").observation == "Inventory: [oak planks] (4) "
    won = env.step("craft 1 crafting table using 4 oak planks")
    assert (won.reward, won.done, won.info) == (1.0, True, {"valid": True, "success": True})
    assert won.observation == "Crafted 1 minecraft:crafting_table"


def test_case_spaces_and_a_full_stop_are_forgiven() -> None:
    env = crafting_table()
    assert env.step("  Get 1   OAK logs. ").observation == "Got 1 oak logs"


@pytest.mark.parametrize(
    ("action", "valid", "failure"),
    [
        ("", False, "unknown_command"),
        ("dance", False, "unknown_command"),
        ("get oak logs", False, "unknown_command"),
        ("get 1 dragon egg shell", False, "unknown_item"),
        ("get 0 oak logs", False, "bad_count"),
        ("get 10000000 oak logs", False, "bad_count"),
        ("get " + "9" * 5000 + " oak logs", False, "bad_count"),
        ("craft 1 crafting table using planks", False, "bad_format"),
        ("craft 1 crafting table using 4 unobtainium", False, "unknown_item"),
        ("craft 1 time machine using 4 oak planks", False, "unknown_item"),
        ("craft 1 crafting table using 0 oak planks", False, "bad_count"),
        ("get 1 crafting table", True, "not_gettable"),
        ("get 4 planks", True, "not_gettable"),
        ("craft 1 crafting table using 4 oak planks", True, "missing_items"),
        ("craft 1 crafting table using 4 planks", True, "missing_items"),
    ],
)
def test_refused_actions_say_why_and_change_nothing(action: str, valid: bool, failure: str) -> None:
    env = crafting_table()
    step = env.step(action)
    assert (step.reward, step.done) == (0.0, False)
    assert step.info == {"valid": valid, "success": False, "failure": failure}
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."


def test_a_recipe_with_wrong_counts_is_refused_silently(capsys: pytest.CaptureFixture[str]) -> None:
    """The package's matcher prints on a wrong count; a server must not log a line per mistake."""
    env = crafting_table()
    env.step("get 2 oak logs")
    env.step("craft 4 oak planks using 1 oak logs")
    env.step("craft 4 oak planks using 1 oak logs")
    step = env.step("craft 1 crafting table using 5 oak planks")
    assert step.info == {"valid": True, "success": False, "failure": "no_recipe"}
    assert capsys.readouterr().out == ""
    assert env.step("inventory").observation == "Inventory: [oak planks] (8) "


def test_a_specific_kind_stands_in_for_a_generic_ingredient_but_not_a_mix() -> None:
    env = crafting_table()
    for action in ["get 1 oak logs", "get 1 birch logs"]:
        env.step(action)
    env.step("craft 4 oak planks using 1 oak logs")
    env.step("craft 4 birch planks using 1 birch logs")
    mixed = env.step("craft 1 crafting table using 2 oak planks, 2 birch planks")
    assert mixed.info["failure"] == "no_recipe"
    assert env.step("craft 1 crafting table using 4 birch planks").reward == 1.0


def test_crafting_something_else_earns_nothing() -> None:
    env = crafting_table()
    env.step("get 1 oak logs")
    env.step("craft 4 oak planks using 1 oak logs")
    step = env.step("craft 4 stick using 2 oak planks")
    assert (step.observation, step.reward, step.done) == ("Crafted 4 minecraft:stick", 0.0, False)
    assert step.info == {"valid": True, "success": False}
