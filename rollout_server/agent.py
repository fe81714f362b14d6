"""Agent episodes: a user's own agent plays a job through a recording session of the worker.

An ``agent`` job names its agent (``RolloutJob.agent``). The worker creates the env instance,
opens a :class:`~rollout_server.session.RecordingSession` and hands the episode over:

* ``package.module:function``: an async function, called in the worker as
  ``await function(client, task, env)`` with an ``openai.AsyncOpenAI`` client whose base URL is
  the session's (``/sessions/{id}/v1``), the :class:`~services.agent_protocol.AgentTask`, and an
  :class:`AgentEnv` that steps the instance. It returns the episode's reward, or None for the
  env's. The agent is written with nothing but the ``openai`` package and needs no stargym import.
* an http(s) URL: an outside harness, in any language, is sent a
  :class:`~services.agent_protocol.HarnessCall` and ends the episode with
  ``POST /sessions/{id}/finish``; it steps the instance over the env server's REST API.
* ``pull``: the same, but outside harnesses take the episodes themselves: ``POST /sessions`` on
  the worker answers the next waiting episode's :class:`~services.agent_protocol.HarnessCall`
  (a harness behind NAT, a notebook, a script: no server of its own).

The trajectory is the session's record (exact sampled ids, behaviour log-probs, loss mask, and
``segments`` where the agent rewrote its history) with the episode's reward on its last turn.
The steps a Python agent takes through :class:`AgentEnv` are credited to the reply before them:
that turn's ``actions``, and ``valid`` False when the env rejected one or the reply held a
tool call that does not parse (so the run's ``invalid_penalty`` and invalid-rate metrics apply
to agents as to the worker's own episodes).
The reward is the agent's, else the env server's total for the instance; ``success`` is the
agent's, else the env's last verdict, else ``reward > 0``.

Failures keep the worker's rules. An env error (creating, stepping, reading the instance) and an
engine error behind a chat call rerun the episode, as for env jobs. What the agent itself does
wrong (an entry point that does not load, an exception, no answer within ``agent_timeout_s``,
no chat call at all, a harness that refuses the call) is published as the trajectory's
``error``: rerunning the same code would fail the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from rollout_server.episode import EpisodeEnvError
from rollout_server.session import RecordingSession, SessionRegistry
from services.agent_protocol import AgentTask, HarnessCall, SessionFinish
from services.env_client import EnvClient, EnvClientError
from services.env_protocol import StepResult
from services.http_client import ClientErrors, HttpClient
from services.rollout_protocol import AGENT_PULL, RolloutJob, Trajectory

AgentFn = Callable[[openai.AsyncOpenAI, AgentTask, "AgentEnv"], Awaitable[float | None]]
"""``async def agent(client, task, env) -> reward | None``."""
MODEL_NAME = "policy"
"""What a session's ``/v1/models`` lists; a request may name any model."""


class AgentError(Exception):
    """The agent failed the episode: published as the trajectory's error, not rerun."""


class HarnessConnectionError(AgentError):
    """An outside harness could not be reached, or dropped the call."""


class HarnessTimeoutError(AgentError):
    """An outside harness did not answer the call in time."""


HARNESS_ERRORS = ClientErrors(HarnessConnectionError, HarnessTimeoutError)
"""How the worker's client of outside harnesses raises (an :class:`HttpClient` with these)."""


def load_agent(entry_point: str) -> AgentFn:
    """The async function ``package.module:function`` names; :class:`AgentError` saying why not."""
    module_name, _, name = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any import-time failure is theirs
        raise AgentError(f"agent {entry_point!r}: importing {module_name} failed: {exc!r}") from exc
    function = getattr(module, name, None)
    if function is None or not inspect.iscoroutinefunction(function):
        raise AgentError(f"agent {entry_point!r}: {module_name} has no async function {name!r}")
    return function  # type: ignore[no-any-return]


@dataclass
class AgentEnv:
    """The episode's env instance, as an agent in Python steps it.

    Env failures raise :class:`~rollout_server.episode.EpisodeEnvError`: the worker reruns the
    episode, so an agent should let them pass.
    """

    envs: EnvClient
    task: AgentTask
    observation: str
    """The latest observation: the first one, then each step's."""
    replies_so_far: Callable[[], int] = lambda: 0
    """How many chat replies the session has given: a step is the act of the latest one."""
    actions: dict[int, list[tuple[str, bool]]] = field(default_factory=dict)
    """Per reply (its index), the steps taken after it: the action and whether the env accepted it."""
    done: bool = False
    success: bool | None = None
    """The env's last verdict (``info.success``), None until a step gives one."""
    steps: int = 0
    error: EpisodeEnvError | None = None
    """The first env failure: the episode is rerun even if the agent caught it."""
    env_s: float = field(default=0.0, repr=False)

    @property
    def instruction(self) -> str:
        return self.task.instruction

    async def step(self, action: str) -> StepResult:
        """Carry ``action`` out; the result's reward counts toward the episode's (the env's total)."""
        result = await self._call(self.envs.step(self.task.instance_id, action), f"step {self.steps}")
        self.steps += 1
        valid = bool(result.info.get("valid", True))
        self.actions.setdefault(self.replies_so_far() - 1, []).append((action, valid))
        self.observation, self.done = result.observation, result.done
        if "success" in result.info:
            self.success = bool(result.info["success"])
        return result

    async def total_reward(self) -> float:
        """The instance's total reward as the env server counts it (every step, whoever sent it)."""
        state = await self._call(self.envs.get(self.task.instance_id), "reading the instance")
        return float(state.total_reward)

    async def available_actions(self) -> list[str] | None:
        """The actions the env accepts now, for envs that list them (None otherwise)."""
        return await self._call(self.envs.available_actions(self.task.instance_id), "available_actions")

    async def _call(self, request: Awaitable[Any], stage: str) -> Any:
        started = time.perf_counter()
        try:
            return await request
        except EnvClientError as exc:
            failure = EpisodeEnvError(
                f"{self.task.env}: {stage} failed: {exc}", stage=stage, instance_id=self.task.instance_id
            )
            self.error = self.error or failure
            raise failure from exc
        finally:
            self.env_s += time.perf_counter() - started


@dataclass(frozen=True)
class AgentHost:
    """Where the worker serves sessions and how agents reach them.

    local_url: the worker as an agent running inside it reaches it (loopback).
    public_url: the worker as an outside harness reaches it (``WorkerSettings.advertised_url``).
    api_key: the worker's API token, or ``EMPTY``.
    timeout_s: the longest an agent may take over one episode.
    harness: the client that sends :class:`HarnessCall` to outside harnesses.
    """

    sessions: SessionRegistry
    local_url: str
    public_url: str
    api_key: str
    timeout_s: float
    harness: HttpClient


async def play_agent_episode(
    job: RolloutJob, envs: EnvClient, instruction: str, session: RecordingSession, host: AgentHost
) -> Trajectory:
    """Play ``job`` with its agent through ``session`` and return the trajectory."""
    assert job.agent is not None
    started = time.perf_counter()
    try:
        created = await envs.create(job.env, seed=job.seed, options=job.options)
    except EnvClientError as exc:
        raise EpisodeEnvError(f"{job.env}: create failed: {exc}", stage="create") from exc
    task = AgentTask(
        job_id=job.job_id,
        env=job.env,
        seed=job.seed,
        options=job.options,
        max_turns=job.max_turns,
        instruction=instruction,
        observation=created.observation,
        env_url=envs.base_url,
        instance_id=created.instance_id,
    )
    env = AgentEnv(envs, task, created.observation, lambda: len(session.record.turns))
    host.sessions.add(session)
    error: str | None = None
    try:
        try:
            outcome = await asyncio.wait_for(_run(job.agent, task, env, session, host), host.timeout_s)
        except TimeoutError:
            raise AgentError(
                f"agent {job.agent!r} did not finish the episode within {host.timeout_s:g} s"
            ) from None
        except (EpisodeEnvError, AgentError):
            raise
        except Exception as exc:  # the agent's own exception, unless a service failed under it
            _rerun_if_a_service_failed(env, session)
            raise AgentError(f"agent {job.agent!r} raised {type(exc).__name__}: {exc}") from exc
        _rerun_if_a_service_failed(env, session)  # an agent that carried on past the failure
        reward = outcome.reward
        if reward is None:
            reward = await env.total_reward()
    except AgentError as exc:
        error, outcome, reward = str(exc), SessionFinish(), 0.0
    finally:
        host.sessions.close(session.session_id)
        with contextlib.suppress(EnvClientError):  # the server's TTL reclaims it; the episode is sound
            await envs.close(created.instance_id)
    record = session.record
    if error is None and not record.turns:
        error = f"agent {job.agent!r} made no chat call through its session: nothing to train on"
    turns = [
        turn.model_copy(
            update={
                "actions": [action for action, _ in env.actions[index]],
                "valid": turn.valid and all(valid for _, valid in env.actions[index]),
            }
        )
        if index in env.actions
        else turn
        for index, turn in enumerate(record.turns)
    ]
    if turns:
        turns[-1] = turns[-1].model_copy(update={"reward": reward, "done": env.done})
    success = outcome.success if outcome.success is not None else env.success
    return Trajectory.from_job(
        job,
        policy_version=session.policy_version,
        turns=turns,
        token_ids=record.token_ids,
        loss_mask=record.loss_mask,
        logprobs=record.logprobs,
        segments=record.segments,
        reward=reward,
        success=success if success is not None else reward > 0,
        num_turns=len(turns),
        truncated=record.truncated,
        error=error,
        timings={
            "total_s": time.perf_counter() - started,
            "generate_s": record.generate_s,
            "busy_wait_s": record.busy_wait_s,
            "env_s": env.env_s,
        },
        worker_id="agent",
    )


def _rerun_if_a_service_failed(env: AgentEnv, session: RecordingSession) -> None:
    """Raise the env or engine failure the episode met, if any: the worker reruns such an episode
    (its record is incomplete) whatever the agent made of the failure."""
    if env.error is not None:
        raise env.error
    if session.engine_error is not None:
        raise session.engine_error


async def _run(
    agent: str, task: AgentTask, env: AgentEnv, session: RecordingSession, host: AgentHost
) -> SessionFinish:
    """Hand the episode to the agent and wait for its end."""
    path = f"/sessions/{session.session_id}"
    call = HarnessCall(
        session_id=session.session_id,
        base_url=f"{host.public_url}{path}/v1",
        finish_url=f"{host.public_url}{path}/finish",
        api_key=host.api_key,
        model=MODEL_NAME,
        task=task,
    )
    if agent == AGENT_PULL:
        host.sessions.offer(call)
        return await host.sessions.finished(session.session_id, host.timeout_s)
    if agent.startswith(("http://", "https://")):
        answer = await host.harness.request("POST", agent, call.model_dump(mode="json"))
        if answer.status >= 300:
            raise AgentError(f"harness {agent} refused the episode: {answer.status} {answer.payload[:200]!r}")
        return await host.sessions.finished(session.session_id, host.timeout_s)
    function = load_agent(agent)
    async with openai.AsyncOpenAI(
        base_url=f"{host.local_url}{path}/v1",
        api_key=host.api_key,
        max_retries=0,
        timeout=host.timeout_s,
        http_client=openai.DefaultAsyncHttpxClient(verify=_tls_context()),
    ) as client:
        returned = await function(client, task, env)
    if returned is not None and not isinstance(returned, int | float):
        raise AgentError(
            f"agent {agent!r} returned {type(returned).__name__}, not a reward (a number) or None"
        )
    return SessionFinish(reward=None if returned is None else float(returned))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every agent's client, made once per process. The client openai builds
    by default makes its own and loads the CA bundle into it: 38 ms a client, 78% of the worker's
    CPU (py-spy) when every episode of a bandit run was an agent's; with this one, 0.4 ms. Each
    episode still gets a client of its own, which the agent may close."""
    return ssl.create_default_context()


def new_session_id() -> str:
    return uuid.uuid4().hex
