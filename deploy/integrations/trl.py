"""TRL's ``GRPOTrainer(environment_factory=…)`` on a stargym env, over OpenEnv's WebSocket protocol.

TRL creates one environment object per rollout slot, calls its ``reset(**row)`` with the dataset
row before each generation (the returned text joins the prompt), exposes its other public
methods as tools the model calls, and hands the objects to the reward functions. So
:class:`StargymEnv` holds one OpenEnv session (one instance on the env server) for its lifetime,
its one public method, the ``act`` tool, steps it, and :func:`episode_reward` reads back what
each episode earned; the server frees the instance when the process and its socket go::

    factory = environment_factory("http://localhost:8101", env="game/sokoban")
    trainer = GRPOTrainer(model=..., train_dataset=Dataset.from_dict({"prompt": ..., "seed": ...}),
                          reward_funcs=episode_reward, environment_factory=factory)

Needs ``openenv-core`` (``pip install openenv-core``), which stargym itself does not depend on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["StargymEnv", "environment_factory", "episode_reward"]


class StargymEnv:
    """One stargym env instance for one TRL rollout: ``reset`` starts an episode, ``act`` plays.

    ``env`` is an id from the server's ``GET /envs`` (``game/sokoban``); ``options`` its reset
    options; ``token`` the server's API token, if it has one.
    """

    def __init__(
        self, base_url: str, env: str, options: dict[str, Any] | None = None, token: str | None = None
    ) -> None:
        from openenv.core.generic_client import GenericEnvClient

        root = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        described = httpx.get(f"{root}/openenv/{env}/metadata", headers=headers, timeout=30)
        described.raise_for_status()
        self.instruction: str = described.json()["description"]
        client = GenericEnvClient(base_url=f"{root}/openenv/{env}")
        if token:
            # openenv-core 0.3.0's client takes no headers; the server reads the token from the
            # query too (services/http_app.py, TokenAuth), and the client connects to _ws_url as is.
            client._ws_url += f"?token={token}"
        self._session = client.sync()
        self._session.connect()
        self._options = options
        self.reward = 0.0
        self.done = False
        self.turns = 0

    def reset(self, seed: int | None = None, **_row: Any) -> str:
        """Start a new episode (the row's ``seed`` picks it; other columns are TRL's) and return
        the instruction and first observation, which TRL appends to the prompt."""
        result = self._session.reset(seed=seed, options=self._options)
        self.reward, self.done, self.turns = 0.0, False, 0
        return f"{self.instruction}\n\n{result.observation['text']}"

    def act(self, action: str) -> str:
        """Take your next action in the environment and see what happens.

        Args:
            action: The action to take, in the format the instructions describe.

        Returns:
            What the environment shows after the action, and whether the episode is over.
        """
        if self.done:
            raise ValueError(f"The episode is over (reward {self.reward:g}); no more actions.")
        result = self._session.step({"text": action})
        self.reward += result.reward or 0.0
        self.done = result.done
        self.turns += 1
        text = result.observation["text"]
        return f"{text}\nThe episode is over; total reward {self.reward:g}." if self.done else text


def environment_factory(
    base_url: str, env: str, options: dict[str, Any] | None = None, token: str | None = None
) -> Callable[[], StargymEnv]:
    """What ``GRPOTrainer(environment_factory=…)`` takes: a no-argument maker of :class:`StargymEnv`."""
    return functools.partial(StargymEnv, base_url, env, options, token)


def episode_reward(environments: list[StargymEnv], **_: Any) -> list[float]:
    """A TRL reward function: what each rollout's episode earned (the env's own reward)."""
    return [environment.reward for environment in environments]
