"""AgentGym-compatible routes, one set per env at ``/agentgym/<name>/``.

An unmodified AgentGym env client (``agentenv.envs.TextCraftEnvClient``, the one AgentGym-RL
trains with) given ``http://host:port/agentgym/<name>`` as its ``env_server_base`` drives our
envs. What those clients do, and so what these routes answer:

- ``POST /create`` (TextCraft's client sends ``{"minecraft_dir", "commands", "goal"}``, BabyAI's
  and SciWorld's no body) → 200 ``{"id", "observation", "reward", "done"}``; the clients read
  ``id`` (TextCraft's also ``observation``) and raise on any status but 200.
- ``POST /reset {"id", "data_idx"}`` → ``{"id", "observation", "reward", "score", "done",
  "task_description"}``: the fields any of the three clients reads. ``data_idx`` is the seed
  unless the env maps it onto its tasks (:meth:`Env.agentgym_task`: BabyAI's level and seed).
- ``POST /step {"id", "action"}`` → ``{"observation", "reward", "score", "done"}``.
- ``GET /observation?id=`` → the current observation as a bare JSON string.
- ``GET /available_actions?id=`` → a JSON list (empty for an open-text env).
- ``POST /close {"id"}`` → bare ``true``.

The clients echo the id they got from /create into bodies and query strings and never parse
it, so ids are the native API's UUIDs and both route sets can drive one instance; an id of
another env's instance is unknown here (404). Errors keep
our real status codes and ``{"error": {...}}`` body where AgentGym answers 200 with
``{"error": "..."}``: its clients assert a 200 either way.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from env_server.core import Env
from env_server.pool import Instance, InstancePool
from env_server.routes import PoolDep
from services.env_protocol import (
    AgentGymClose,
    AgentGymCreate,
    AgentGymCreated,
    AgentGymReset,
    AgentGymResetResult,
    AgentGymStep,
    AgentGymStepResult,
)
from services.errors import not_found

# What /create starts with before the client picks its task with /reset, as AgentGym's do.
CREATE_SEED = 0


def agentgym_router(env_id: str, env_class: type[Env]) -> APIRouter:
    """The AgentGym route set for one env; mount it with prefix ``/agentgym/<name>``."""
    router = APIRouter(tags=[f"agentgym: {env_class.name}"])

    def own(pool: InstancePool, instance_id: str) -> Instance:
        """The instance, if it is one of this env's: a TextCraft client must not drive a bandit."""
        instance = pool.get(instance_id)
        if instance.env_id != env_id:
            raise not_found(f"{env_id} instance", instance_id)
        return instance

    @router.post("/create", response_model=AgentGymCreated)
    async def create(pool: PoolDep, body: Annotated[AgentGymCreate | None, Body()] = None) -> AgentGymCreated:
        # The body is only validated: a custom task in it is a 422, the rest carries nothing we use.
        instance, first = await pool.create(env_id, CREATE_SEED, None)
        return AgentGymCreated(id=instance.instance_id, observation=first.observation)

    @router.post("/reset", response_model=AgentGymResetResult)
    async def reset(body: AgentGymReset, pool: PoolDep) -> AgentGymResetResult:
        own(pool, body.id)
        seed, options = env_class.agentgym_task(body.data_idx)
        observed = await pool.reset(body.id, seed, options)
        return AgentGymResetResult(id=body.id, observation=observed.observation)

    @router.post("/step", response_model=AgentGymStepResult)
    async def step(body: AgentGymStep, pool: PoolDep) -> AgentGymStepResult:
        instance = own(pool, body.id)  # held, so a close right after the step cannot hide the score
        result = await pool.step(body.id, body.action)
        return AgentGymStepResult(
            observation=result.observation,
            reward=result.reward,
            score=instance.total_reward,
            done=result.done,
        )

    @router.get("/observation", response_model=str)
    async def observation(pool: PoolDep, id: Annotated[str, Query()]) -> str:
        return own(pool, id).observation

    @router.get("/available_actions", response_model=list[str])
    async def available_actions(pool: PoolDep, id: Annotated[str, Query()]) -> list[str]:
        return own(pool, id).env.available_actions() or []

    @router.post("/close", response_model=bool)
    async def close(body: AgentGymClose, pool: PoolDep) -> bool:
        own(pool, body.id)
        await pool.close(body.id)
        return True

    return router
