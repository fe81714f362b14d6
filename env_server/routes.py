"""The env HTTP API of docs/architecture.md: list envs, and create / step / reset / inspect / close instances."""

from __future__ import annotations

import functools
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.exceptions import ResponseValidationError
from pydantic import ValidationError
from starlette.convertors import Convertor, register_url_convertor

from env_server.core import Env, Observation, Step
from env_server.options_schema import check_option_types, options_schema
from env_server.pool import Instance, InstancePool
from services.env_protocol import (
    INSTANCE_ID_PATTERN,
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
from services.errors import ApiError
from services.fast_route import NO_BODY, FastPathRoute
from services.http_app import OrjsonResponse
from services.openapi import error_responses, refusals

router = APIRouter(tags=["instances"])


class InstanceIdConvertor(Convertor[str]):
    """Routes only path segments that can be instance ids to the ``{instance_id}`` routes.

    Otherwise ``/instances/{instance_id}`` would also match ``/instances/step``: a GET there would
    be "instance 'step' does not exist" instead of a 405 naming POST, the one method of that path.
    """

    regex = INSTANCE_ID_PATTERN

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("instance_id", InstanceIdConvertor())
INSTANCE_PATH = "/instances/{instance_id:instance_id}"
STEP_PATH_FORMAT = "/instances/{instance_id}/step"
"""The step route's template; its plainest requests never reach it (env_server.step_fast_path)."""
InstanceId = Annotated[str, Path(pattern=f"^{INSTANCE_ID_PATTERN}$", description="From POST /instances.")]
OPTIONS_REFUSED = refusals(
    422,
    {
        "invalid_options": "the env refuses these options by a rule of its own beyond their schema "
        "(one option against another, a seed it cannot make a task from with them; on reset, options "
        "of another env than the instance's)"
    },
)


async def get_pool(request: Request) -> InstancePool:
    # async: FastAPI runs a plain ``def`` dependency on a worker thread, a hop per request that
    # cost more server CPU than the env step itself.
    return request.app.state.pool


PoolDep = Annotated[InstancePool, Depends(get_pool)]


def env_spec(env_id: str, env_class: type[Env]) -> EnvSpec:
    return EnvSpec(
        id=env_id,
        name=env_class.name,
        family=env_class.family,
        instruction=env_class.instruction,
        action_format=env_class.action_format,
        default_max_turns=env_class.default_max_turns,
        reward_range=env_class.reward_range,
        options_schema=options_schema(env_class),
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


def observed_payload(observed: Observation) -> dict[str, Any]:
    """An observation as ``Observed`` JSON, the way :func:`step_payload` builds a step's."""
    if type(observed.observation) is str and _plain_json(observed.info):
        return {"observation": observed.observation, "info": observed.info}
    try:
        result = Observed(observation=observed.observation, info=observed.info)
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


class BatchStepRoute(FastPathRoute):
    """``POST /instances/step`` whose items are each exactly ``{"instance_id", "action"}`` strings."""

    async def fast(self, request: Request, payload: Any) -> Response | None:
        if type(payload) is not dict or len(payload) != 1:
            return None
        items = payload.get("steps")
        if type(items) is not list or len(items) > MAX_BATCH:
            return None
        requests = []
        for item in items:
            if type(item) is not dict or len(item) != 2:
                return None
            instance_id, action = item.get("instance_id"), item.get("action")
            if type(instance_id) is not str or type(action) is not str:
                return None
            requests.append((instance_id, action))
        return await batch_response(request.app.state.pool, requests)


class ResetRoute(FastPathRoute):
    """``POST /instances/{id}/reset`` with no body, or ``{"seed"?: int, "options"?: {...}}``."""

    async def fast(self, request: Request, payload: Any) -> Response | None:
        if payload is NO_BODY:
            seed, options = None, None
        elif type(payload) is dict and payload.keys() <= {"seed", "options"}:
            seed, options = payload.get("seed"), payload.get("options")
            if seed is not None and not (type(seed) is int and 0 <= seed < 2**63):
                return None
            if options is not None and type(options) is not dict:
                return None
        else:
            return None
        pool: InstancePool = request.app.state.pool
        observed = await reset_checked(pool, request.path_params["instance_id"], seed, options)
        return OrjsonResponse(observed_payload(observed))


async def reset_checked(
    pool: InstancePool, instance_id: str, seed: int | None, options: dict[str, Any] | None
) -> Observation:
    """``pool.reset``, with the options' types checked against the instance's env first."""
    check_option_types(pool.env_classes[pool.get(instance_id).env_id], options)
    return await pool.reset(instance_id, seed, options)


MAX_BATCH = next(
    m.max_length for m in BatchStepRequest.model_fields["steps"].metadata if hasattr(m, "max_length")
)


async def batch_response(pool: InstancePool, requests: list[tuple[str, str]]) -> Response:
    """``BatchStepResponse`` JSON built from dicts: models per item would cost more than the steps."""
    outcomes = await pool.step_many(requests)
    results = []
    for (instance_id, _), outcome in zip(requests, outcomes, strict=True):
        if isinstance(outcome, ApiError):
            error = {"code": outcome.code, "message": outcome.message}
            results.append({"instance_id": instance_id, "result": None, "error": error})
        else:
            results.append({"instance_id": instance_id, "result": step_payload(outcome), "error": None})
    return OrjsonResponse({"results": results})


# The step routes come first: routes are matched in order, and every route tried before the one
# that matches costs each step a few microseconds.


async def step_instance(instance_id: InstanceId, body: StepRequest, pool: PoolDep) -> Response:
    step = await pool.step(instance_id, body.action)
    return OrjsonResponse(step_payload(step))


async def step_instances(body: BatchStepRequest, pool: PoolDep) -> Response:
    return await batch_response(pool, [(item.instance_id, item.action) for item in body.steps])


async def reset_instance(
    instance_id: InstanceId, pool: PoolDep, body: ResetRequest | None = None
) -> Response:
    body = body or ResetRequest()
    observed = await reset_checked(pool, instance_id, body.seed, body.options)
    return OrjsonResponse(observed_payload(observed))


router.add_api_route(
    f"{INSTANCE_PATH}/step",
    step_instance,
    methods=["POST"],
    response_model=StepResult,
    responses=error_responses(404, 409, 502, descriptions={409: "The episode is over: reset the instance."}),
)
router.add_api_route(
    "/instances/step",
    step_instances,
    methods=["POST"],
    response_model=BatchStepResponse,
    route_class_override=BatchStepRoute,
)
router.add_api_route(
    f"{INSTANCE_PATH}/reset",
    reset_instance,
    methods=["POST"],
    response_model=Observed,
    responses={**error_responses(404, 502), **OPTIONS_REFUSED},
    route_class_override=ResetRoute,
)


@router.get("/envs", response_model=EnvList, tags=["envs"])
async def list_envs(pool: PoolDep) -> Response:
    return Response(env_list_json(tuple(pool.env_classes.items())), media_type="application/json")


@functools.cache
def env_list_json(env_classes: tuple[tuple[str, type[Env]], ...]) -> bytes:
    """``GET /envs``'s body, built once per server: a server's envs never change, and the reasoning
    family's 100 option schemas took 0.2-0.3 s to build and validate on every request."""
    envs = EnvList(envs=[env_spec(env_id, cls) for env_id, cls in env_classes])
    return orjson.dumps(envs.model_dump(mode="json"))


@router.post(
    "/instances",
    response_model=InstanceCreated,
    status_code=201,
    responses={
        **error_responses(
            404, 429, 502, descriptions={404: "No env of this id on this server.", 429: "The instance limit."}
        ),
        **OPTIONS_REFUSED,
    },
)
async def create_instance(body: CreateInstance, pool: PoolDep) -> InstanceCreated:
    env_class = pool.env_classes.get(body.env)
    if env_class is not None:  # else the pool's 404
        check_option_types(env_class, body.options)
    instance, first = await pool.create(body.env, body.seed, body.options)
    return InstanceCreated(instance_id=instance.instance_id, observation=first.observation, info=first.info)


@router.get("/instances", response_model=InstanceList)
async def list_instances(pool: PoolDep) -> InstanceList:
    states = [instance_state(instance) for instance in pool.instances.values()]
    return InstanceList(instances=states, count=len(states), limit=pool.max_instances)


@router.get(INSTANCE_PATH, response_model=InstanceState, responses=error_responses(404))
async def get_instance(instance_id: InstanceId, pool: PoolDep) -> InstanceState:
    return instance_state(pool.get(instance_id))


@router.get(
    f"{INSTANCE_PATH}/available_actions", response_model=list[str] | None, responses=error_responses(404)
)
async def available_actions(instance_id: InstanceId, pool: PoolDep) -> list[str] | None:
    return pool.get(instance_id).runner.available_actions()


@router.delete(INSTANCE_PATH, status_code=204, response_class=Response, responses=error_responses(404))
async def close_instance(instance_id: InstanceId, pool: PoolDep) -> Response:
    await pool.close(instance_id)
    return Response(status_code=204)
