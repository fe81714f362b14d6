"""What a rollout worker and an agent harness say to each other about one agent episode.

An ``agent`` job (one whose :attr:`services.rollout_protocol.JobFields.agent` is set) is played by the user's
agent through a recording session of the worker (``/sessions/{id}/v1``, OpenAI-compatible). An
agent in Python is called in the worker with an :class:`AgentTask`; a harness outside Python
(another language, another machine) is sent a :class:`HarnessCall` at its URL and reports the
episode's end with ``POST /sessions/{id}/finish`` (:class:`SessionFinish`). Both ends read these
models: unknown fields are refused, so a harness and a worker that disagree fail loudly.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from services.env_protocol import RequestModel, Seed
from services.rollout_protocol import RolloutWireModel


class AgentTask(RolloutWireModel):
    """The episode an agent plays: the env instance the worker created for it, and its limits."""

    job_id: str
    env: str = Field(description="The env id, e.g. 'game/bandit'.")
    seed: Seed
    options: dict[str, Any] | None = Field(default=None, description="The env options it was created with.")
    max_turns: int = Field(gt=0, description="Chat calls the session answers; the next is a 400.")
    instruction: str = Field(description="The env's instruction (GET /envs), for the agent's prompt.")
    observation: str = Field(description="The env's first observation.")
    env_url: str = Field(description="The env server holding the instance.")
    instance_id: str = Field(
        description="The instance, stepped at POST {env_url}/instances/{instance_id}/step; the worker "
        "closes it when the episode ends."
    )


class HarnessCall(RolloutWireModel):
    """``POST <harness URL>``: play this episode through this session, then finish it.

    The harness answers 2xx once it has taken the episode (at once, or after it finished); any
    other answer fails the episode. It then sends its chat calls to ``base_url`` with ``api_key``
    as the bearer token (the OpenAI SDK's ``base_url`` and ``api_key``) and ends with
    ``POST finish_url`` (:class:`SessionFinish`).
    """

    session_id: str
    base_url: str = Field(description="The session's OpenAI base URL, ending in /v1.")
    finish_url: str
    api_key: str = Field(description="The worker's API token, or 'EMPTY' when it has none.")
    model: str = Field(description="The model name the session lists (any name is accepted).")
    task: AgentTask


class SessionFinish(RequestModel):
    """``POST /sessions/{id}/finish``: the episode is over.

    ``reward`` None takes the env's: the instance's total reward as the env server reports it.
    ``success`` None takes the env's verdict when a step gave one, else ``reward > 0``.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    reward: float | None = None
    success: bool | None = None


class SessionFinished(RolloutWireModel):
    """The answer to :class:`SessionFinish`: what the session recorded."""

    session_id: str
    turns: int
    segments: int = Field(
        description="Sequences the trajectory holds (1 unless the agent rewrote its history)."
    )
