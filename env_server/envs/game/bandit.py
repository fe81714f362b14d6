"""RAGEN's two-armed bandit: a safe arm with a small sure payout, a risky arm with a rare large one.

The risky arm is worth more in expectation (0.25 × 1.0 > 0.15), but a policy that learns from a
handful of samples is tempted by the sure thing: a small test of whether RL finds the better
gamble. The arms are shown in an order shuffled per seed, so position carries no signal.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

from env_server.core import Env, Observation, Step


class BanditOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    safe_arm: str = Field(default="Phoenix", min_length=1, description="Name of the arm that always pays.")
    risky_arm: str = Field(
        default="Dragon", min_length=1, description="Name of the arm that pays rarely but big."
    )
    safe_payout: float = 0.15
    risky_payout: float = 1.0
    risky_probability: float = Field(default=0.25, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def distinct_names(self) -> BanditOptions:
        if self.safe_arm.strip().lower() == self.risky_arm.strip().lower():
            raise ValueError("the two arms need different names")
        return self


class BanditEnv(Env):
    name = "bandit"
    family = "game"
    instruction = (
        "You are playing a two-armed bandit. Each arm pays a reward when pulled; one pays a small "
        "amount every time, the other pays a large amount only sometimes. Pull the arm you expect "
        "to earn the most. Reply with the name of one arm."
    )
    action_format = "the name of one arm, e.g. 'Dragon'"
    default_max_turns = 1
    reward_range = (0.0, 1.0)
    Options = BanditOptions
    runs_inline = True
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py

    def __init__(self) -> None:
        self._rng = random.Random()
        self._options = BanditOptions()
        self._arms: list[str] = []

    def reset(self, seed: int, options: BanditOptions) -> Observation:
        self._rng = random.Random(seed)
        self._options = options
        self._arms = [options.safe_arm, options.risky_arm]
        self._rng.shuffle(self._arms)
        text = f"There are two arms: {self._arms[0]} and {self._arms[1]}. Which arm do you pull?"
        return Observation(text, {"arms": list(self._arms)})

    def available_actions(self) -> list[str]:
        return list(self._arms)

    def step(self, action: str) -> Step:
        chosen = action.strip().strip(".'\"").lower()
        options = self._options
        if chosen == options.risky_arm.lower():
            won = self._rng.random() < options.risky_probability
            reward = options.risky_payout if won else 0.0
            return Step(
                f"You pulled {options.risky_arm} and won {reward:g}.",
                reward,
                True,
                {"valid": True, "success": True, "arm": options.risky_arm},
            )
        if chosen == options.safe_arm.lower():
            reward = options.safe_payout
            return Step(
                f"You pulled {options.safe_arm} and won {reward:g}.",
                reward,
                True,
                {"valid": True, "success": False, "arm": options.safe_arm},
            )
        return Step(
            f"'{action.strip()}' is not an arm. Reply with {self._arms[0]} or {self._arms[1]}.",
            0.0,
            False,
            {"valid": False},
        )
