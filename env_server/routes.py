"""The env HTTP API of DESIGN.md: list envs, and create / step / reset / inspect / close instances."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from env_server.core import Env
from env_server.pool import HostOptions, Instance, InstancePool
from services.errors import ApiError
from services.protocol import (
    BatchStepOutcome,
    BatchStepRequest,
    BatchStepResponse,
    CreateInstance,
    EnvList,
    EnvSpec,
    ErrorBody,
    InstanceCreated,
    InstanceList,
    InstanceState,
    Observed,
    ResetRequest,
    StepRequest,
    StepResult,
)

router = APIRouter(tags=["instances"])


def get_pool(request: Request) -> InstancePool:
    return request.app.state.pool


PoolDep = Annotated[InstancePool, Depends(get_pool)]


def env_spec(env_id: str, env_class: type[Env]) -> EnvSpec:
    schema = env_class.Options.model_json_schema()
    schema.setdefault("properties", {}).update(HostOptions.model_json_schema()["properties"])
    return EnvSpec(
        id=env_id,
        name=env_class.name,
        family=env_class.family,
        instruction=env_class.instruction,
        action_format=env_class.action_format,
        default_max_turns=env_class.default_max_turns,
        reward_range=env_class.reward_range,
        options_schema=schema,
    )


def instance_state(instance: Instance) -> InstanceState:
    return InstanceState(
        instance_id=instance.instance_id,
        env=instance.env_id,
        seed=instance.seed,
        options=instance.options,
        observation=instance.observation,
        done=instance.done,
        turns=instance.turns,
        total_reward=instance.total_reward,
        created_at=instance.created_at,
        last_used_at=instance.last_used_at,
    )


@router.get("/envs", response_model=EnvList, tags=["envs"])
async def list_envs(pool: PoolDep) -> EnvList:
    return EnvList(envs=[env_spec(env_id, cls) for env_id, cls in pool.env_classes.items()])


@router.post("/instances", response_model=InstanceCreated, status_code=201)
async def create_instance(body: CreateInstance, pool: PoolDep) -> InstanceCreated:
    instance, first = await pool.create(body.env, body.seed, body.options)
    return InstanceCreated(instance_id=instance.instance_id, observation=first.observation, info=first.info)


@router.get("/instances", response_model=InstanceList)
async def list_instances(pool: PoolDep) -> InstanceList:
    states = [instance_state(instance) for instance in pool.instances.values()]
    return InstanceList(instances=states, count=len(states), limit=pool.max_instances)


@router.post("/instances/step", response_model=BatchStepResponse)
async def step_instances(body: BatchStepRequest, pool: PoolDep) -> BatchStepResponse:
    outcomes = await pool.step_many([(item.instance_id, item.action) for item in body.steps])
    results = []
    for item, outcome in zip(body.steps, outcomes, strict=True):
        if isinstance(outcome, ApiError):
            error = ErrorBody(code=outcome.code, message=outcome.message)
            results.append(BatchStepOutcome(instance_id=item.instance_id, error=error))
        else:
            result = StepResult(
                observation=outcome.observation, reward=outcome.reward, done=outcome.done, info=outcome.info
            )
            results.append(BatchStepOutcome(instance_id=item.instance_id, result=result))
    return BatchStepResponse(results=results)


@router.get("/instances/{instance_id}", response_model=InstanceState)
async def get_instance(instance_id: str, pool: PoolDep) -> InstanceState:
    return instance_state(pool.get(instance_id))


@router.post("/instances/{instance_id}/step", response_model=StepResult)
async def step_instance(instance_id: str, body: StepRequest, pool: PoolDep) -> StepResult:
    step = await pool.step(instance_id, body.action)
    return StepResult(observation=step.observation, reward=step.reward, done=step.done, info=step.info)


@router.post("/instances/{instance_id}/reset", response_model=Observed)
async def reset_instance(instance_id: str, pool: PoolDep, body: ResetRequest | None = None) -> Observed:
    body = body or ResetRequest()
    observed = await pool.reset(instance_id, body.seed, body.options)
    return Observed(observation=observed.observation, info=observed.info)


@router.get("/instances/{instance_id}/available_actions", response_model=list[str] | None)
async def available_actions(instance_id: str, pool: PoolDep) -> list[str] | None:
    return pool.get(instance_id).env.available_actions()


@router.delete("/instances/{instance_id}", status_code=204, response_class=Response)
async def close_instance(instance_id: str, pool: PoolDep) -> Response:
    await pool.close(instance_id)
    return Response(status_code=204)
