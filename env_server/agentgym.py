"""AgentGym-compatible routes, one set per env at ``/agentgym/<name>/``.

AgentGym's env servers speak ``/create``, ``/step``, ``/reset``, ``/observation``,
``/available_actions`` and ``/close`` with their own field names; an unmodified AgentGym client
given ``http://host:port/agentgym/<name>`` as its base URL trains against our envs. The ids are
the same UUIDs as the native API's, so both route sets can drive one instance.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query

from env_server.core import Env
from env_server.routes import PoolDep
from services.protocol import AgentGymClose, AgentGymCreated, AgentGymReset, AgentGymStep, AgentGymStepResult


def agentgym_router(env_id: str, env_class: type[Env]) -> APIRouter:
    """The AgentGym route set for one env; mount it with prefix ``/agentgym/<name>``."""
    router = APIRouter(tags=[f"agentgym: {env_class.name}"])

    @router.post("/create", response_model=AgentGymCreated)
    async def create(pool: PoolDep, body: Annotated[dict[str, Any] | None, Body()] = None) -> AgentGymCreated:
        # AgentGym creates with data_idx 0 and picks the task with a later /reset; extra fields
        # some AgentGym servers take at create (e.g. TextCraft's commands/goal) are ignored.
        instance, _ = await pool.create(env_id, 0, None)
        return AgentGymCreated(id=instance.instance_id)

    @router.post("/step", response_model=AgentGymStepResult)
    async def step(body: AgentGymStep, pool: PoolDep) -> AgentGymStepResult:
        result = await pool.step(body.id, body.action)
        return AgentGymStepResult(observation=result.observation, reward=result.reward, done=result.done)

    @router.post("/reset")
    async def reset(body: AgentGymReset, pool: PoolDep) -> dict[str, Any]:
        observed = await pool.reset(body.id, body.data_idx, None)
        return {"id": body.id, "observation": observed.observation, "reward": 0.0, "done": False}

    @router.get("/observation", response_model=str)
    async def observation(pool: PoolDep, id: Annotated[str, Query()]) -> str:
        return pool.get(id).observation

    @router.get("/available_actions", response_model=list[str])
    async def available_actions(pool: PoolDep, id: Annotated[str, Query()]) -> list[str]:
        return pool.get(id).env.available_actions() or []

    @router.post("/close")
    async def close(body: AgentGymClose, pool: PoolDep) -> dict[str, Any]:
        await pool.close(body.id)
        return {"closed": True}

    return router
