"""The env interface: what a user subclasses to add an environment in one file.

An env is a plain, single-threaded Python object. The host gives each instance its own object
and lock, so an env never needs to be thread-safe, but it must keep all randomness in its own
RNG (seeded in :meth:`Env.reset`): many instances reset concurrently and a shared global RNG
would make the same seed give different states.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from fastapi import APIRouter


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


class EnvFailure(Exception):
    """The env's backing process died or hung (a crashed JVM): this instance cannot go on.

    Raised from :meth:`Env.reset` or :meth:`Env.step`; the message names the cause. The host
    closes the instance (so its resources are released) and answers 502 ``env_failed``; other
    instances are unaffected. An action the env merely cannot carry out is not a failure: that
    is a :class:`Step` with ``info["valid"] = False``.
    """


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
    # The AgentGym client dialect served at /agentgym/<name>/ (env_server/agentgym.py): "id" for
    # TextCraft-, BabyAI- and SciWorld-style clients, "env_idx" for SearchQA's, "webshop" for
    # WebShop's (an env of that dialect is a :class:`env_server.agentgym.WebPageEnv`).
    agentgym_dialect: ClassVar[Literal["id", "env_idx", "webshop"]] = "id"
    # What `stargym model init` plays (each option set for its number of seeds) so the tiny policy's
    # vocabulary covers what a policy of this env will read and say; default: the default options.
    vocabulary_options: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    # Strings the tiny policy makes single tokens besides the actions it sees: the fixed markers of
    # an open-text action syntax (SearchQA's tags), so a random policy can say them at all.
    vocabulary_actions: ClassVar[tuple[str, ...]] = ()
    # True when reset and step cost microseconds: the host then runs them on its event loop instead
    # of hopping to a worker thread, which would cost more than the call itself.
    runs_inline: ClassVar[bool] = False
    # True when the env's author vouches that every call returns promptly: the host then runs it in
    # its own process (inline or on a thread), where nothing could stop a call that hangs. Any other
    # env runs one process per instance, killed when a call takes longer than ``step_timeout_s``
    # (env_server/sandbox.py); that costs each step an exchange over a Unix socket (bench/sandbox.py).
    trusted: ClassVar[bool] = False

    @classmethod
    def env_id(cls) -> str:
        return f"{cls.family}/{cls.name}"

    @classmethod
    def agentgym_task(cls, data_idx: int) -> tuple[int, dict[str, Any] | None]:
        """The seed and options that AgentGym's ``/reset {"data_idx"}`` means for this env.

        Default: the index is the seed and the instance keeps its options. Envs whose AgentGym
        server maps the index onto tasks (BabyAI's 40 levels) override this.
        """
        return data_idx, None

    async def start(self) -> None:  # noqa: B027 - optional hook, most envs need nothing scarce
        """Acquire a scarce resource (a JVM from a bounded pool) before the first reset.

        The host awaits this on its event loop, so waiting for a free resource holds no worker
        thread; it may raise :class:`services.errors.ApiError` (429 when none frees up in time).
        The host calls :meth:`close` whenever the instance goes away, started or not.
        """

    @abc.abstractmethod
    def reset(self, seed: int, options: BaseModel) -> Observation:
        """Start a new episode; the same ``seed`` and ``options`` must give the same episode."""

    @abc.abstractmethod
    def step(self, action: str) -> Step:
        """Apply one action (already split from a multi-action reply by the host)."""

    def available_actions(self) -> list[str] | None:
        """The actions valid now, or None when the action space is open text."""
        return None

    @classmethod  # noqa: B027 - optional hook, most envs share nothing
    def prepare(cls) -> None:
        """Load what the class's instances share (a corpus and its index) before the server
        listens: a bad setting then stops the server with its message, instead of failing every
        create, and the first create is not the slow one. May raise :class:`EnvFailure`."""

    @classmethod
    def routers(cls) -> list[APIRouter]:
        """HTTP routes the env serves beside the host's, mounted at the server's root: pages a
        person opens in a browser (web/shop's shop at ``/shop/<instance id>/``). Handlers reach
        the instances through :data:`env_server.routes.PoolDep`. Most envs serve none."""
        return []

    @classmethod  # noqa: B027 - optional hook, most envs share nothing
    def shutdown(cls) -> None:
        """Release what the class shares between its instances (a JVM pool). The host calls it
        once when it stops, after it has closed every instance: uvicorn re-raises SIGTERM after
        its shutdown, so ``atexit`` hooks never run in a server."""

    def close(self) -> None:  # noqa: B027 - optional hook, most envs hold nothing to release
        """Release what the env holds (processes, files). Called once when its instance goes away."""
