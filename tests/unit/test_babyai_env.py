"""The BabyAI env on real levels: options, AgentGym's level mapping, determinism, rewards and endings."""

from __future__ import annotations

import json
import re

import gymnasium
import pytest
from minigrid.utils.baby_ai_bot import BabyAIBot
from pydantic import ValidationError

from env_server.envs.embodied.babyai import AGENTGYM_LEVELS, BabyAIEnv, BabyAIOptions

GO_TO_RED_BALL = "BabyAI-GoToRedBall-v0"
PICKUP_LOC = "BabyAI-PickupLoc-v0"
AHEAD = re.compile(r"There is a ([a-z]+(?: [a-z]+)* \d+) right in front of you 1 steps away\.")


def listed(observation: str) -> list[str]:
    return json.loads(observation.rsplit("Available actions: ", 1)[1])


def test_options_take_a_babyai_id_or_an_agentgym_level_number() -> None:
    assert BabyAIOptions().level == GO_TO_RED_BALL
    assert BabyAIOptions(level="BabyAI-UnlockLocal-v0").level == "BabyAI-UnlockLocal-v0"
    assert BabyAIOptions(level=1).level == "BabyAI-GoToRedBallGrey-v0"
    assert BabyAIOptions(level=40).level == "BabyAI-BossLevelNoUnlock-v0"
    assert BabyAIOptions.model_validate({"level": 19}).level == "BabyAI-PickupLoc-v0"


@pytest.mark.parametrize(
    "options",
    [
        {"level": 0},
        {"level": 41},
        {"level": "BabyAI-Nope-v0"},
        {"level": "MiniGrid-Empty-5x5-v0"},
        {"level": True},
        {"level": [2]},
        {"lvl": 2},
    ],
)
def test_bad_options_are_rejected(options: dict) -> None:
    with pytest.raises(ValidationError):
        BabyAIOptions.model_validate(options)


@pytest.mark.parametrize(
    ("data_idx", "level", "layout_seed"), [(0, 1, 0), (41, 2, 1), (79, 40, 1), (122, 3, 3)]
)
def test_agentgym_data_idx_maps_to_level_and_seed_as_agentgym_rl_does(
    data_idx: int, level: int, layout_seed: int
) -> None:
    """AgentGym's ``data_idx`` and a mix's ``level: agentgym`` seed give the explicit level's episode."""
    assert len(AGENTGYM_LEVELS) == 40 and len(set(AGENTGYM_LEVELS)) == 40
    seed, options = BabyAIEnv.agentgym_task(data_idx)
    mapped, explicit = BabyAIEnv(), BabyAIEnv()
    first = mapped.reset(seed, BabyAIOptions.model_validate(options))
    assert first.info["level"] == AGENTGYM_LEVELS[level - 1]
    assert first.observation == explicit.reset(layout_seed, BabyAIOptions(level=level)).observation
    action = mapped.available_actions()[-2]
    assert mapped.step(action).observation == explicit.step(action).observation
    mapped.close()
    explicit.close()


def test_every_agentgym_level_starts_with_its_goal_and_actions() -> None:
    env = BabyAIEnv()
    for number in range(1, 41):
        first = env.reset(number, BabyAIOptions(level=number))
        assert first.observation.startswith("Your goal: ")
        assert first.info["level"] == AGENTGYM_LEVELS[number - 1]
        assert listed(first.observation) == env.available_actions()
        assert env.available_actions()[:2] == ["turn left", "turn right"]
    env.close()


def test_same_seed_same_episode_other_seeds_other_episodes() -> None:
    def play(seed: int) -> list[str]:
        env = BabyAIEnv()
        texts = [env.reset(seed, BabyAIOptions(level=PICKUP_LOC)).observation]
        for _ in range(6):
            texts.append(env.step(env.available_actions()[-2]).observation)
        return texts

    assert play(5) == play(5)
    assert len({play(seed)[0] for seed in range(8)}) == 8


def test_reset_on_one_instance_replays_the_episode() -> None:
    env = BabyAIEnv()
    first = env.reset(3, BabyAIOptions()).observation
    env.step("turn left")
    env.reset(4, BabyAIOptions(level=5))
    assert env.reset(3, BabyAIOptions()).observation == first


def test_success_reward_is_minigrids_and_matches_the_same_moves_on_a_twin() -> None:
    """The bot's moves, as text actions, earn what the same moves earn on minigrid itself."""
    level, seed = PICKUP_LOC, 3
    env = BabyAIEnv()
    text = env.reset(seed, BabyAIOptions(level=level)).observation
    twin = gymnasium.make(level).unwrapped
    twin.reset(seed=seed)
    bot = BabyAIBot(twin)
    names = {0: "turn left", 1: "turn right", 2: "move forward", 5: "toggle"}
    move, step = None, None
    for _ in range(64):
        move = bot.replan(move)
        # Picking up the object in front is "pick up <its label>" with no path to walk first.
        action = f"pick up {AHEAD.search(text)[1]}" if move == 3 else names[int(move)]
        step = env.step(action)
        text = step.observation
        _, reward, terminated, truncated, _ = twin.step(move)
        assert (step.reward, step.done) == (reward, terminated or truncated)
        if step.done:
            break
    assert step is not None and step.done and step.info == {"valid": True, "success": True}
    assert 0.0 < step.reward == 1 - 0.9 * twin.step_count / twin.max_steps
    assert step.observation.split("\n")[-2] == "The task is completed."


def test_invalid_actions_take_no_step_and_running_out_of_steps_ends_the_episode() -> None:
    env = BabyAIEnv()
    env.reset(0, BabyAIOptions(level=PICKUP_LOC))  # turning never picks anything up
    twin = gymnasium.make(PICKUP_LOC).unwrapped
    twin.reset(seed=0)  # minigrid sets the step limit at reset: 64 here
    max_steps = twin.max_steps
    invalid = env.step("fly")
    assert (invalid.reward, invalid.done, invalid.info) == (0.0, False, {"valid": False})
    for turn in range(max_steps):
        step = env.step("turn left")
        assert step.done == (turn == max_steps - 1)
    assert (step.reward, step.info) == (0.0, {"valid": True, "success": False})
    assert step.observation.split("\n")[-2] == "You have used up the step limit of this task."
