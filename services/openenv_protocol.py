"""OpenEnv's WebSocket session protocol, as every stargym env server speaks it under ``/openenv/``.

OpenEnv (``openenv-core``; what TRL, verifiers and SkyRL connect to) runs an episode over one
WebSocket: the client sends ``{"type": "reset"|"step"|"state"|"close", "data": …}`` and gets
``{"type": "observation", "data": {"observation", "reward", "done"}}``, ``{"type": "state", "data"}``
or ``{"type": "error", "data": {"message", "code"}}`` back. These are those messages with OpenEnv's
own field names and error codes, so its unmodified clients (``GenericEnvClient``) work; what is
stargym's own is the text action and observation every env shares (``{"text"}`` in,
``{"text", "info"}`` out) and the reset fields that pick the env and its options.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.env_protocol import JsonDict, Seed, WireModel


class OpenEnvErrorCode(StrEnum):
    """OpenEnv's ``WSErrorCode`` values: the ``code`` of every error message."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"


class ResetData(WireModel):
    """What a ``reset`` message carries. The first reset of a session creates its env instance
    (counted against the server's instance limit); later ones reset it, or replace it when they
    name another env."""

    seed: Seed | None = Field(
        default=None, description="Same seed, same episode; omitted: a new random episode."
    )
    episode_id: str | None = Field(default=None, max_length=255, description="Echoed in the state.")
    env: str | None = Field(
        default=None,
        description="An id from GET /envs; default: the env of the session's URL "
        "(/openenv/game/sokoban/ws). Required on /openenv/ws.",
    )
    options: JsonDict | None = Field(
        default=None, description="The env's reset options (GET /envs); omitted: keep the session's."
    )


class TextAction(BaseModel):
    """A ``step`` message's data: the agent's reply. ``metadata`` is OpenEnv's ``Action`` field,
    accepted and ignored, so typed OpenEnv clients built from ``/schema`` work too."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="The agent's reply; the env parses its action(s) from it.")
    metadata: JsonDict = Field(default_factory=dict)


class TextObservation(BaseModel):
    """An observation as OpenEnv's ``/schema`` describes it: the env's text and info, with
    OpenEnv's ``done``/``reward`` (sent beside the observation, not in it, as OpenEnv does)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    info: JsonDict = Field(default_factory=dict, description="The env's info: valid, success, …")
    done: bool = False
    reward: float | None = None


class SessionState(BaseModel):
    """A ``state`` answer: OpenEnv's ``State`` fields (``episode_id``, ``step_count``) and the
    session's instance."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str | None = None
    step_count: int = Field(default=0, ge=0)
    env: str | None = None
    instance_id: str | None = None
    seed: int | None = None
    done: bool = False
    total_reward: float = 0.0


class ObservationMessage(WireModel):
    type: Literal["observation"] = "observation"
    data: JsonDict = Field(description="{observation: {text, info}, reward, done}")


class StateMessage(WireModel):
    type: Literal["state"] = "state"
    data: JsonDict


class ErrorMessage(WireModel):
    type: Literal["error"] = "error"
    data: JsonDict = Field(description="{message, code} and, for stargym's own errors, reason")


class Schemas(WireModel):
    """``GET …/schema``: OpenEnv's ``SchemaResponse``."""

    action: JsonDict
    observation: JsonDict
    state: JsonDict


class OpenEnvMetadata(WireModel):
    """``GET …/metadata``: OpenEnv's ``EnvironmentMetadata``."""

    name: str
    description: str
    readme_content: str | None = None
    version: str | None = None
    author: str | None = None
    documentation_url: str | None = None


class OpenEnvHealth(WireModel):
    status: Literal["healthy"] = "healthy"


def observation_data(text: str, info: dict[str, Any], reward: float | None, done: bool) -> JsonDict:
    """The ``data`` of an observation message, in the layout OpenEnv's clients parse."""
    return {"observation": {"text": text, "info": info}, "reward": reward, "done": done}
