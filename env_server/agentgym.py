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

AgentGym's SearchQA server speaks another dialect (``Env.agentgym_dialect = "env_idx"``): its
client sends ``/create {"id": 0}`` and keeps the bare JSON answer as its ``env_idx``, which it then
puts in every body (``/step {"env_idx", "action"}``, ``/reset {"env_idx", "id"}`` with the task
index as ``id``, ``/close {"env_idx"}``) and query (``GET /observation?env_idx=``); ``/reset``
answers the bare observation string and ``/step`` ``{"observation", "reward", "done", "info"}``.

AgentGym's WebShop server (``Env.agentgym_dialect = "webshop"``, envs that are a
:class:`WebPageEnv`): ``/create`` without a body answers the bare ``env_idx``; ``/reset
{"env_idx", "session_id"}`` answers ``[observation, null]`` (its client then reads ``GET
/observation?env_idx=``); ``/step {"env_idx", "action"}`` answers ``{"state", "reward", "done",
"info": null}``; ``GET /available_actions`` ``{"has_search_bar", "clickables"}`` (lower case),
``GET /instruction_text`` the bare instruction, ``GET /state`` ``{"url", "html",
"instruction_text"}``, and ``/close {"env_idx"}`` ``{"closed": true}``. A ``session_id`` of null
resets the instance to the goal it was created with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Protocol, cast

from fastapi import APIRouter, Body, Query

from env_server.core import Env
from env_server.pool import Instance, InstancePool
from env_server.routes import PoolDep
from services.env_protocol import (
    AgentGymClose,
    AgentGymCreate,
    AgentGymCreated,
    AgentGymIndexedClose,
    AgentGymIndexedCreate,
    AgentGymIndexedReset,
    AgentGymIndexedStep,
    AgentGymIndexedStepResult,
    AgentGymReset,
    AgentGymResetResult,
    AgentGymShopActions,
    AgentGymShopClosed,
    AgentGymShopReset,
    AgentGymShopState,
    AgentGymShopStepResult,
    AgentGymStep,
    AgentGymStepResult,
)
from services.errors import not_found
from services.openapi import error_responses, refusals

# What /create starts with before the client picks its task with /reset, as AgentGym's do.
CREATE_SEED = 0
CREATED = error_responses(429, 502, descriptions={429: "The server's instance limit."})
OF_THIS_ENV = error_responses(404, descriptions={404: "No instance of this env with this id."})
STEPPED = error_responses(404, 409, 502, descriptions={409: "The episode is over: reset the instance."})
RESET = {
    **error_responses(404, 502),
    **refusals(422, {"invalid_options": "the env has no task of this index (past its last one)"}),
}


class WebPageEnv(Protocol):
    """What the WebShop dialect reads of an env whose state is a web page."""

    def page_html(self) -> str: ...

    def clickables(self) -> list[str]: ...

    @property
    def has_search_bar(self) -> bool: ...

    def page_url(self) -> str: ...

    def instruction_text(self) -> str: ...


def agentgym_router(env_id: str, env_class: type[Env]) -> APIRouter:
    """The AgentGym route set for one env, in its dialect; mount it with prefix ``/agentgym/<name>``."""
    router = APIRouter(tags=[f"agentgym: {env_class.name}"])
    if env_class.agentgym_dialect == "env_idx":
        _add_env_idx_routes(router, env_id, env_class)
    elif env_class.agentgym_dialect == "webshop":
        _add_webshop_routes(router, env_id, env_class)
    else:
        _add_id_routes(router, env_id, env_class)
    return router


def _owner(env_id: str) -> Callable[[InstancePool, str], Instance]:
    def own(pool: InstancePool, instance_id: str) -> Instance:
        """The instance, if it is one of this env's: a TextCraft client must not drive a bandit."""
        instance = pool.get(instance_id)
        if instance.env_id != env_id:
            raise not_found(f"{env_id} instance", instance_id)
        return instance

    return own


def _add_id_routes(router: APIRouter, env_id: str, env_class: type[Env]) -> None:
    """TextCraft's, BabyAI's and SciWorld's dialect: the instance is ``id``."""
    own = _owner(env_id)

    @router.post("/create", response_model=AgentGymCreated, responses=CREATED)
    async def create(pool: PoolDep, body: Annotated[AgentGymCreate | None, Body()] = None) -> AgentGymCreated:
        # The body is only validated: a custom task in it is a 422, the rest carries nothing we use.
        instance, first = await pool.create(env_id, CREATE_SEED, None)
        return AgentGymCreated(id=instance.instance_id, observation=first.observation)

    @router.post("/reset", response_model=AgentGymResetResult, responses=RESET)
    async def reset(body: AgentGymReset, pool: PoolDep) -> AgentGymResetResult:
        own(pool, body.id)
        seed, options = env_class.agentgym_task(body.data_idx)
        observed = await pool.reset(body.id, seed, options)
        return AgentGymResetResult(id=body.id, observation=observed.observation)

    @router.post("/step", response_model=AgentGymStepResult, responses=STEPPED)
    async def step(body: AgentGymStep, pool: PoolDep) -> AgentGymStepResult:
        instance = own(pool, body.id)  # held, so a close right after the step cannot hide the score
        result = await pool.step(body.id, body.action)
        return AgentGymStepResult(
            observation=result.observation,
            reward=result.reward,
            score=instance.total_reward,
            done=result.done,
        )

    @router.get("/observation", response_model=str, responses=OF_THIS_ENV)
    async def observation(pool: PoolDep, id: Annotated[str, Query()]) -> str:
        return own(pool, id).observation

    @router.get("/available_actions", response_model=list[str], responses=OF_THIS_ENV)
    async def available_actions(pool: PoolDep, id: Annotated[str, Query()]) -> list[str]:
        return own(pool, id).runner.available_actions() or []

    @router.post("/close", response_model=bool, responses=OF_THIS_ENV)
    async def close(body: AgentGymClose, pool: PoolDep) -> bool:
        own(pool, body.id)
        await pool.close(body.id)
        return True


def _add_env_idx_routes(router: APIRouter, env_id: str, env_class: type[Env]) -> None:
    """SearchQA's dialect: the instance is ``env_idx``; /create and /reset answer bare strings."""
    own = _owner(env_id)

    @router.post("/create", response_model=str, responses=CREATED)
    async def create(pool: PoolDep, body: Annotated[AgentGymIndexedCreate | None, Body()] = None) -> str:
        instance, _ = await pool.create(env_id, CREATE_SEED, None)
        return instance.instance_id

    @router.post("/reset", response_model=str, responses=RESET)
    async def reset(body: AgentGymIndexedReset, pool: PoolDep) -> str:
        own(pool, body.env_idx)
        seed, options = env_class.agentgym_task(body.id)
        observed = await pool.reset(body.env_idx, seed, options)
        return observed.observation

    @router.post("/step", response_model=AgentGymIndexedStepResult, responses=STEPPED)
    async def step(body: AgentGymIndexedStep, pool: PoolDep) -> AgentGymIndexedStepResult:
        own(pool, body.env_idx)
        result = await pool.step(body.env_idx, body.action)
        return AgentGymIndexedStepResult(
            observation=result.observation, reward=result.reward, done=result.done, info=result.info
        )

    @router.get("/observation", response_model=str, responses=OF_THIS_ENV)
    async def observation(pool: PoolDep, env_idx: Annotated[str, Query()]) -> str:
        return own(pool, env_idx).observation

    @router.post("/close", response_model=bool, responses=OF_THIS_ENV)
    async def close(body: AgentGymIndexedClose, pool: PoolDep) -> bool:
        own(pool, body.env_idx)
        await pool.close(body.env_idx)
        return True


def _add_webshop_routes(router: APIRouter, env_id: str, env_class: type[Env]) -> None:
    """WebShop's dialect: the instance is ``env_idx``; the env is a web page (:class:`WebPageEnv`)."""
    own = _owner(env_id)
    members = ("clickables", "has_search_bar", "page_url", "page_html", "instruction_text")
    missing = [name for name in members if not hasattr(env_class, name)]
    if missing:  # a wiring mistake of the env's author: the server refuses to start
        raise TypeError(f"{env_id} declares the webshop dialect but lacks {', '.join(missing)} (WebPageEnv)")

    def page_of(pool: InstancePool, env_idx: str) -> WebPageEnv:
        return cast(WebPageEnv, own(pool, env_idx).env)

    @router.post("/create", response_model=str, responses=CREATED)
    async def create(pool: PoolDep) -> str:
        instance, _ = await pool.create(env_id, CREATE_SEED, None)
        return instance.instance_id

    @router.post("/reset", response_model=tuple[str, None], responses=RESET)
    async def reset(body: AgentGymShopReset, pool: PoolDep) -> tuple[str, None]:
        instance = own(pool, body.env_idx)
        if body.session_id is None:
            seed, options = instance.seed, None
        else:
            seed, options = env_class.agentgym_task(body.session_id)
        observed = await pool.reset(body.env_idx, seed, options)
        return observed.observation, None

    @router.post("/step", response_model=AgentGymShopStepResult, responses=STEPPED)
    async def step(body: AgentGymIndexedStep, pool: PoolDep) -> AgentGymShopStepResult:
        own(pool, body.env_idx)
        result = await pool.step(body.env_idx, body.action)
        return AgentGymShopStepResult(state=result.observation, reward=result.reward, done=result.done)

    @router.get("/observation", response_model=str, responses=OF_THIS_ENV)
    async def observation(pool: PoolDep, env_idx: Annotated[str, Query()]) -> str:
        return own(pool, env_idx).observation

    @router.get("/available_actions", response_model=AgentGymShopActions, responses=OF_THIS_ENV)
    async def available_actions(pool: PoolDep, env_idx: Annotated[str, Query()]) -> AgentGymShopActions:
        page = page_of(pool, env_idx)
        labels = [label.lower() for label in page.clickables()]
        return AgentGymShopActions(has_search_bar=page.has_search_bar, clickables=labels)

    @router.get("/instruction_text", response_model=str, responses=OF_THIS_ENV)
    async def instruction_text(pool: PoolDep, env_idx: Annotated[str, Query()]) -> str:
        return page_of(pool, env_idx).instruction_text()

    @router.get("/state", response_model=AgentGymShopState, responses=OF_THIS_ENV)
    async def state(pool: PoolDep, env_idx: Annotated[str, Query()]) -> AgentGymShopState:
        page = page_of(pool, env_idx)
        return AgentGymShopState(
            url=page.page_url(), html=page.html, instruction_text=page.instruction_text()
        )

    @router.post("/close", response_model=AgentGymShopClosed, responses=OF_THIS_ENV)
    async def close(body: AgentGymIndexedClose, pool: PoolDep) -> AgentGymShopClosed:
        own(pool, body.env_idx)
        await pool.close(body.env_idx)
        return AgentGymShopClosed(closed=True)
