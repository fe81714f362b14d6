"""The env HTTP API of DESIGN.md: list envs, and create / step / reset / inspect / close instances."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import ResponseValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError

from env_server.core import Env, Step
from env_server.pool import HostOptions, Instance, InstancePool
from services.errors import ApiError
from services.http_app import OrjsonResponse
from services.protocol import (
    BatchStepRequest,
    BatchStepResponse,
    CreateInstance,
    EnvList,
    EnvSpec,
    InstanceCreated,
    InstanceList,
    InstanceState,
    Observed,
    ResetRequest,
    StepRequest,
    StepResult,
)

router = APIRouter(tags=["instances"])


async def get_pool(request: Request) -> InstancePool:
    # async: FastAPI runs a plain ``def`` dependency on a worker thread, a hop per request that
    # cost more server CPU than the env step itself.
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


def step_payload(step: Step) -> dict[str, Any]:
    """A step as ``StepResult`` JSON. The hot path: built as a dict, validated only when unusual.

    The routes return it in a response directly, which skips FastAPI's response-model
    validation; the dict is exactly what that would have produced for plain JSON values, and
    anything else goes through the model as before.
    """
    if (
        type(step.observation) is str
        and type(step.done) is bool
        and type(step.reward) in (float, int)
        and _plain_json(step.info)
    ):
        return {
            "observation": step.observation,
            "reward": float(step.reward),
            "done": step.done,
            "info": step.info,
        }
    try:
        result = StepResult(observation=step.observation, reward=step.reward, done=step.done, info=step.info)
    except ValidationError as exc:
        raise ResponseValidationError(exc.errors()) from exc
    return result.model_dump(mode="json")


def _plain_json(value: Any) -> bool:
    """True for str, int, float, bool, None, and lists and str-keyed dicts of them."""
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and _plain_json(v) for k, v in value.items())
    if kind is list:
        return all(_plain_json(v) for v in value)
    return kind in _JSON_SCALARS


_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


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


# The two step routes come first: routes are matched in order, and every route tried before the
# one that matches costs each step a few microseconds.


class StepRoute(APIRoute):
    """The single-step route, with a fast path for the request every rollout makes many times.

    A JSON body that is exactly ``{"action": "<text>"}`` is stepped straight away: FastAPI's
    content-type parsing, dependency solving and body validation cost several times the step
    itself. Any other body (malformed, extra fields, wrong types, another content type) goes to
    the regular FastAPI handler, so errors, their status codes and messages are unchanged, and
    the route (with its OpenAPI schema) is an ordinary ``APIRoute`` to routing and middleware.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        regular = super().get_route_handler()

        async def handler(request: Request) -> Response:
            action = _plain_action(request, await request.body())
            if action is None:
                return await regular(request)
            pool: InstancePool = request.app.state.pool
            step = await pool.step(request.path_params["instance_id"], action)
            return OrjsonResponse(step_payload(step))

        return handler


def _plain_action(request: Request, body: bytes) -> str | None:
    """The action of a body that FastAPI would accept as a ``StepRequest``, else None."""
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        return None
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(payload) is not dict or len(payload) != 1:
        return None
    action = payload.get("action")
    return action if type(action) is str else None


async def step_instance(instance_id: str, body: StepRequest, pool: PoolDep) -> Response:
    step = await pool.step(instance_id, body.action)
    return OrjsonResponse(step_payload(step))


router.add_api_route(
    "/instances/{instance_id}/step",
    step_instance,
    methods=["POST"],
    response_model=StepResult,
    route_class_override=StepRoute,
)


@router.post("/instances/step", response_model=BatchStepResponse)
async def step_instances(body: BatchStepRequest, pool: PoolDep) -> Response:
    # Answered as ``BatchStepResponse`` JSON built from dicts: models per item cost more than the steps.
    requests = [(item.instance_id, item.action) for item in body.steps]
    outcomes = await pool.step_many(requests)
    results = []
    for (instance_id, _), outcome in zip(requests, outcomes, strict=True):
        if isinstance(outcome, ApiError):
            error = {"code": outcome.code, "message": outcome.message}
            results.append({"instance_id": instance_id, "result": None, "error": error})
        else:
            results.append({"instance_id": instance_id, "result": step_payload(outcome), "error": None})
    return OrjsonResponse({"results": results})


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


@router.get("/instances/{instance_id}", response_model=InstanceState)
async def get_instance(instance_id: str, pool: PoolDep) -> InstanceState:
    return instance_state(pool.get(instance_id))


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
