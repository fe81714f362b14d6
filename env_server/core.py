"""The env interface: what a user subclasses to add an environment in one file.

An env is a plain, single-threaded Python object. The host gives each instance its own object
and lock, so an env never needs to be thread-safe, but it must keep all randomness in its own
RNG (seeded in :meth:`Env.reset`): many instances reset concurrently and a shared global RNG
would make the same seed give different states.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


@dataclass(slots=True)
class Observation:
    """What the agent sees after a reset."""

    observation: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Step:
    """The outcome of one action. ``info["valid"]`` is False when the action could not be carried out."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class NoOptions(BaseModel):
    """The options model of an env that takes none; unknown keys are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


class Env(abc.ABC):
    """Base class of every environment.

    Subclasses set the class metadata and implement :meth:`reset`, :meth:`step` and, when the
    action set is finite, :meth:`available_actions`. ``Options`` is a pydantic model of what the
    env accepts at reset; the host validates user input against it and answers 422 on a mismatch.
    Invalid actions return a :class:`Step` with ``info["valid"] = False``; they never raise.
    """

    name: ClassVar[str]
    family: ClassVar[str]
    instruction: ClassVar[str]
    action_format: ClassVar[str]
    default_max_turns: ClassVar[int]
    reward_range: ClassVar[tuple[float, float]]
    Options: ClassVar[type[BaseModel]] = NoOptions
    # True when reset and step cost microseconds: the host then runs them on its event loop instead
    # of hopping to a worker thread, which would cost more than the call itself.
    runs_inline: ClassVar[bool] = False

    @classmethod
    def env_id(cls) -> str:
        return f"{cls.family}/{cls.name}"

    @abc.abstractmethod
    def reset(self, seed: int, options: BaseModel) -> Observation:
        """Start a new episode; the same ``seed`` and ``options`` must give the same episode."""

    @abc.abstractmethod
    def step(self, action: str) -> Step:
        """Apply one action (already split from a multi-action reply by the host)."""

    def available_actions(self) -> list[str] | None:
        """The actions valid now, or None when the action space is open text."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most envs hold nothing to release
        """Release what the env holds (processes, files). Called once when its instance goes away."""
