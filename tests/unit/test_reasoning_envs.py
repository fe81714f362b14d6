"""The reasoning family in-process: every hosted dataset's questions and scores, attempts, options."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reasoning_answers import reasoning_gym_item, reference_answer
from reasoning_gym.factory import DATASETS

from env_server.envs.reasoning import items
from env_server.envs.reasoning.catalog import EXCLUDED, hosted_datasets
from env_server.envs.reasoning.hosted import ENV_CLASSES
from env_server.envs.reasoning.items import MAX_CONFIGS_PER_DATASET, shared_dataset
from env_server.envs.reasoning.reply_guard import EVALS_THE_REPLY, PARSES_THE_REPLY_WITH_SYMPY, is_arithmetic
from env_server.pool import parse_options
from env_server.registry import ENTRY_POINT_GROUP
from services.errors import ApiError

INFOS = {info.name: info for info in hosted_datasets()}


def env_for(name: str, options: dict[str, Any] | None = None, seed: int = 0):
    env_class = ENV_CLASSES[f"reasoning/{name}"]
    env = env_class()
    env_options, _ = parse_options(env_class, options or {})
    return env, env.reset(seed, env_options)


def test_entry_points_are_exactly_the_generated_classes() -> None:
    points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name.startswith("reasoning/")}
    assert sorted(points) == sorted(ENV_CLASSES)
    for env_id, point in points.items():
        assert point.load() is ENV_CLASSES[env_id]
    assert set(INFOS) | set(EXCLUDED) == set(DATASETS) and not set(INFOS) & set(EXCLUDED)
    assert len(ENV_CLASSES) == 100


@pytest.mark.parametrize("name", sorted(INFOS))
def test_every_dataset_asks_reasoning_gyms_question_and_scores_with_its_scorer(name: str) -> None:
    seed = 5
    env, first = env_for(name, {"max_attempts": 2}, seed)
    entry = reasoning_gym_item(name, seed)
    assert first.observation == entry["question"]
    assert first.info == {"dataset": name, "index": seed, "attempts_left": 2}
    wrong = env.step("wrong")
    assert (wrong.done, wrong.reward, wrong.info["valid"], wrong.info["success"]) == (False, 0.0, True, False)
    assert wrong.info["score"] < 1.0 and "answer" not in wrong.info
    right = env.step(reference_answer(name, entry))
    assert (right.done, right.reward, right.info["success"], right.observation) == (
        True,
        1.0,
        True,
        "Correct.",
    )
    assert right.info["answer"] == entry["answer"]
    # a seed past the item count wraps around to the same item, in a fresh instance
    assert env_for(name, seed=INFOS[name].item_count + seed)[1].observation == entry["question"]


def test_concurrent_resets_give_the_sequential_questions() -> None:
    """The datasets that use the process's RNGs or write to themselves, with threads switching
    every microsecond: without the isolation of ``items``, list_functions and pool_matrix differ."""
    names = ["list_functions", "pool_matrix", "tsumego", "word_ladder", "basic_arithmetic", "maze"]
    jobs = [(name, seed) for name in names for seed in range(12)]
    sequential = [env_for(name, seed=seed)[1].observation for name, seed in jobs]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(8) as pool:
            concurrent = list(pool.map(lambda job: env_for(job[0], seed=job[1])[1].observation, jobs * 2))
    finally:
        sys.setswitchinterval(interval)
    assert concurrent == sequential * 2


def test_datasets_are_built_once_per_config_and_the_least_recently_used_go() -> None:
    env_class = ENV_CLASSES["reasoning/basic_arithmetic"]

    def dataset(max_terms: int):
        return shared_dataset(
            INFOS["basic_arithmetic"], env_class.Options(config={"max_terms": max_terms}).config
        )

    first = dataset(10)
    assert dataset(10) is first
    for max_terms in range(11, 11 + MAX_CONFIGS_PER_DATASET):
        dataset(max_terms)
    assert dataset(10) is not first  # dropped as the least recently used, then built again


def test_the_process_rngs_are_left_as_they_were() -> None:
    random.seed(11)
    np.random.seed(11)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    for name in ("list_functions", "pool_matrix"):
        env_for(name, seed=3)
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state, strict=True))


def test_wrong_attempts_are_told_to_try_again_and_only_the_last_is_rewarded() -> None:
    gold = reasoning_gym_item("basic_arithmetic", 7)["answer"]
    env, _ = env_for("basic_arithmetic", {"max_attempts": 3}, seed=7)
    steps = [env.step("12345678"), env.step("   "), env.step(f"{gold} {gold}")]
    assert [s.observation for s in steps] == [
        "Wrong (score 0). Try again: 2 attempts left.",
        "Empty answer (score 0). Try again: 1 attempt left.",
        f"Wrong (score {steps[2].info['score']:g}).",
    ]
    assert [(s.done, s.reward, s.info["valid"], s.info["attempts_left"]) for s in steps[:2]] == [
        (False, 0.0, True, 2),
        (False, 0.0, False, 1),
    ]
    # the default scorer's partial credit, len(answer)/len(reply), is the reward of the last attempt
    partial = len(gold) / (2 * len(gold) + 1)
    assert (steps[2].done, steps[2].reward, steps[2].info["success"]) == (True, pytest.approx(partial), False)
    assert steps[2].info["answer"] == gold and "answer" not in steps[1].info
    # the same partial answer before the last attempt earns nothing
    env, _ = env_for("basic_arithmetic", {"max_attempts": 2}, seed=7)
    assert env.step(f"{gold} {gold}").reward == 0.0
    last = env.step(gold)
    assert (last.done, last.reward, last.info["attempts_left"]) == (True, 1.0, 0)


def test_the_last_answer_block_is_graded() -> None:
    gold = reasoning_gym_item("basic_arithmetic", 2)["answer"]
    env, _ = env_for("basic_arithmetic", seed=2)
    reply = f"<think>maybe 1</think><answer>1</answer> no: <answer> {gold} </answer>"
    assert env.step(reply).info["success"]
    env, _ = env_for("basic_arithmetic", seed=2)
    assert not env.step(f"<answer>{gold}</answer><answer>1</answer>").info["success"]


def test_a_config_changes_the_questions_as_in_reasoning_gym() -> None:
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    for seed in range(5):
        env, first = env_for("basic_arithmetic", {"config": config}, seed)
        entry = reasoning_gym_item("basic_arithmetic", seed, config)
        assert first.observation == entry["question"]
        assert env.step(entry["answer"]).reward == 1.0


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "basic_arithmetic",
            {"config": {"min_terms": 5, "max_terms": 2}},
            "reasoning/basic_arithmetic: config: Value error, reasoning-gym refuses this config: "
            "max_terms must be >= min_terms",
        ),
        ("basic_arithmetic", {"config": {"nope": 1}}, "config.nope: Extra inputs are not permitted"),
        ("basic_arithmetic", {"config": {"seed": 1}}, "config.seed: Extra inputs are not permitted"),
        (
            "basic_arithmetic",
            {"config": {"min_terms": "two"}},
            "config.min_terms: Input should be a valid integer",
        ),
        ("maze", {"max_attempts": 0}, "max_attempts: Input should be greater than or equal to 1"),
        ("maze", {"max_attempts": 11}, "max_attempts: Input should be less than or equal to 10"),
        ("word_ladder", {"config": {"max_word_length": 9}}, "max_word_length must be <= 5"),
    ],
)
def test_bad_options_are_422_with_reasoning_gyms_message(name: str, options: dict, message: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_options(ENV_CLASSES[f"reasoning/{name}"], options)
    assert (raised.value.status, raised.value.code) == (422, "invalid_options")
    assert message in raised.value.message


def test_a_config_only_the_dataset_refuses_is_422_at_reset() -> None:
    with pytest.raises(ApiError) as raised:
        env_for("rush_hour", {"config": {"min_moves": 200, "max_moves": 300}})
    assert raised.value.status == 422
    assert raised.value.message == (
        "reasoning/rush_hour: reasoning-gym cannot build this config: "
        "No puzzles found with moves between 200 and 300"
    )


def test_an_item_reasoning_gym_cannot_make_is_422_and_leaves_other_seeds_alone() -> None:
    """word_ladder gives up on seed 0's 12-word ladder of 3 letters and then sets its size to the
    index it failed at: without the copy per item, every later seed would be "out of range"."""
    tight = {
        "config": {"min_word_length": 3, "max_word_length": 3, "min_chain_length": 12, "max_chain_length": 12}
    }
    with pytest.raises(ApiError) as raised:
        env_for("word_ladder", tight, seed=0)
    assert raised.value.status == 422
    assert raised.value.message == (
        "reasoning/word_ladder: reasoning-gym cannot make item 0 with these options: "
        "Dataset exhausted at index 0. Failed to find valid pair for length 3"
    )
    assert (
        env_for("word_ladder", tight, seed=1)[1].observation
        == reasoning_gym_item("word_ladder", 1, tight["config"])["question"]
    )


def test_an_item_over_its_work_budget_is_replaced_by_the_next_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """basic_arithmetic's item 207,006,210 ran 62 s untraced; within the budget it is given up in
    about a second and the next index asked instead, the same on every call."""
    slow = 207_006_210
    first, second = (env_for("basic_arithmetic", seed=slow)[1] for _ in range(2))
    assert first == second
    assert first.info["index"] == slow + 1
    assert first.observation == reasoning_gym_item("basic_arithmetic", slow + 1)["question"]
    # An ordinary seed keeps its own index, and a budget no item fits refuses the seed.
    assert env_for("basic_arithmetic", seed=5)[1].info["index"] == 5
    monkeypatch.setattr(items, "ITEM_LINE_BUDGET", 10)
    with pytest.raises(ApiError) as raised:
        env_for("basic_arithmetic", seed=5)
    assert raised.value.status == 422 and "ran over 10 lines of Python" in raised.value.message


def test_every_options_schema_shows_the_config_and_its_defaults() -> None:
    for env_id, env_class in ENV_CLASSES.items():
        schema = env_class.Options.model_json_schema()
        assert set(schema["properties"]) == {"config", "max_attempts"}, env_id
        config = schema["$defs"][schema["properties"]["config"]["$ref"].rsplit("/", 1)[1]]
        assert config["additionalProperties"] is False and "seed" not in config["properties"]
        defaults = env_class.Options().config
        assert config["properties"].keys() == type(defaults).model_fields.keys()
        # the defaults shown are ones the env accepts back
        assert env_class.Options.model_validate({"config": defaults.model_dump(mode="json")}) is not None
    word_ladder = ENV_CLASSES["reasoning/word_ladder"].Options.model_json_schema()["$defs"][
        "WordLadderConfig"
    ]
    assert word_ladder["properties"]["max_word_length"] == {
        "default": 4,
        "description": "Maximum word length",
        "title": "Max Word Length",
        "type": "integer",
    }


def test_metadata_describes_the_dataset() -> None:
    maze = ENV_CLASSES["reasoning/maze"]
    assert (maze.env_id(), maze.family, maze.reward_range, maze.default_max_turns) == (
        "reasoning/maze",
        "reasoning",
        (0.0, 1.0),
        1,
    )
    assert maze.instruction.startswith("reasoning-gym's maze dataset (games): Generates mazes")
    assert "<answer>" in maze.action_format
    assert ENV_CLASSES["reasoning/number_format"].instruction.startswith(
        "reasoning-gym's number_format dataset (arithmetic): Pick the largest or smallest"
    )


@pytest.fixture
def trap(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ran"
    yield path
    assert not path.exists(), "a reply ran as code"


@pytest.mark.parametrize("name", sorted(EVALS_THE_REPLY | PARSES_THE_REPLY_WITH_SYMPY))
def test_replies_never_run_as_code(name: str, trap: Path) -> None:
    code = f"__import__('pathlib').Path({str(trap)!r}).touch()"
    for reply in (code, f"[{code}]", f"x + {code}", f"<answer>{code}</answer>"):
        env, _ = env_for(name, seed=1)
        assert env.step(reply).reward == 0.0


def test_simple_integrations_integral_wrapper_is_refused() -> None:
    env, _ = env_for("simple_integration", seed=3)
    integrand = reasoning_gym_item("simple_integration", 3)["metadata"]["integrand"]
    assert env.step(f"Integral({integrand}, x)").reward == 0.0


@pytest.mark.parametrize(
    ("text", "arithmetic"),
    [
        ("-5*X**9 - 2*X**6/3 + 4*X**3 + C", True),
        ("x**(3/2) - x**-1 + 2**10", True),
        ("(1 + 2) * 3 / 4", True),
        ("9**9**9", False),
        ("(9**99)**99", False),
        ("10**5000", False),
        ("(" + "9" * 4000 + ")**1000", False),
        ("sin(x)", False),
        ("x.real", False),
        ("'1'", False),
        ("__debug__", False),
        ("3!", False),
    ],
)
def test_what_counts_as_arithmetic(text: str, arithmetic: bool) -> None:
    assert is_arithmetic(text) is arithmetic
