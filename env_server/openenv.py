"""OpenEnv's WebSocket sessions on every env server: ``/openenv/<family>/<name>/ws`` and ``/openenv/ws``.

A session is one WebSocket connection holding at most one env instance of the server's pool: its
first ``reset`` creates the instance (so it counts against the same instance limit, and the
reaper closes it when idle like any other), ``step`` plays the text action through the pool
(locks, multi-action turns and all), and the instance is closed when the socket closes, however
it closes. Served natively rather than through ``openenv-core``'s server, which hosts one env
type per app and brings ~450 MB of dependencies. Message layouts: :mod:`services.openenv_protocol`.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

import orjson
from fastapi import APIRouter, Request, WebSocket
from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocketDisconnect

from env_server.core import Env
from env_server.pool import Instance, InstancePool
from env_server.routes import PoolDep, observed_payload, step_payload
from services.errors import ApiError, not_found, validation_problems
from services.http_app import model_json
from services.openapi import error_responses
from services.openenv_protocol import (
    ErrorMessage,
    ObservationMessage,
    OpenEnvErrorCode,
    OpenEnvHealth,
    OpenEnvMetadata,
    ResetData,
    Schemas,
    SessionState,
    StateMessage,
    TextAction,
    TextObservation,
    observation_data,
)

router = APIRouter(prefix="/openenv", tags=["openenv"])

# What stargym's own errors are in OpenEnv's codes: a full server is OpenEnv's "capacity reached";
# what the client sent wrong, its "validation error"; an env that failed or refused, "execution".
_CODE_BY_STATUS = {429: OpenEnvErrorCode.CAPACITY_REACHED, 404: OpenEnvErrorCode.VALIDATION_ERROR}
_CODE_BY_STATUS.update(dict.fromkeys((400, 413, 422), OpenEnvErrorCode.VALIDATION_ERROR))


class SessionError(Exception):
    """A message the session answers with an error, staying open."""

    def __init__(self, code: OpenEnvErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra

    @classmethod
    def from_api_error(cls, error: ApiError) -> SessionError:
        code = _CODE_BY_STATUS.get(error.status, OpenEnvErrorCode.EXECUTION_ERROR)
        return cls(code, error.message, reason=error.code)

    def message(self) -> ErrorMessage:
        return ErrorMessage(data={"message": str(self), "code": self.code.value, **self.extra})


class Session:
    """One WebSocket's episode state: its instance in the pool, if it has one yet."""

    def __init__(self, pool: InstancePool, default_env: str | None) -> None:
        self.pool = pool
        self.default_env = default_env
        self.instance: Instance | None = None
        self.episode_id: str | None = None

    async def handle(self, raw: str | bytes) -> BaseModel | None:
        """The answer to one message, or None for ``close``."""
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SessionError(OpenEnvErrorCode.INVALID_JSON, f"Invalid JSON: {exc}") from None
        if not isinstance(message, dict):
            raise SessionError(OpenEnvErrorCode.VALIDATION_ERROR, "a message is a JSON object {type, data}")
        kind = message.get("type")
        if kind == "close":
            return None
        if kind == "state":
            return StateMessage(data=self.state().model_dump())
        if kind not in ("reset", "step"):
            raise SessionError(
                OpenEnvErrorCode.UNKNOWN_TYPE,
                f"Unknown message type: {kind!r}; expected reset, step, state or close",
            )
        data = message.get("data", {})
        try:
            if kind == "reset":
                return await self.reset(ResetData.model_validate(data))
            return await self.step(TextAction.model_validate(data))
        except ValidationError as exc:
            raise SessionError(
                OpenEnvErrorCode.VALIDATION_ERROR,
                f"{kind}: {validation_problems(exc, 'data')}",
                errors=exc.errors(include_url=False, include_context=False),
            ) from None
        except ApiError as exc:
            raise SessionError.from_api_error(exc) from None

    async def reset(self, data: ResetData) -> ObservationMessage:
        previous = self.instance
        env_id = data.env or (previous.env_id if previous else self.default_env)
        if env_id is None:
            raise SessionError(
                OpenEnvErrorCode.VALIDATION_ERROR,
                "reset: name the env (data.env, an id from GET /envs) or connect to /openenv/<env id>/ws",
            )
        if env_id not in self.pool.env_classes:
            raise not_found("env", env_id)
        # OpenEnv's reset without a seed is a new episode (the native API's replays the last one).
        seed = secrets.randbelow(2**31) if data.seed is None else data.seed
        same_env = previous is not None and previous.env_id == env_id
        if same_env and previous.instance_id in self.pool.instances:
            observed = await self.pool.reset(previous.instance_id, seed, data.options)
        else:  # the first reset, another env, or an instance the reaper closed while the session idled
            kept = previous.options if same_env else None
            options = data.options if data.options is not None else kept
            instance, observed = await self.pool.create(env_id, seed, options)
            await self.close_instance()
            self.instance = instance
        self.episode_id = data.episode_id
        payload = observed_payload(observed)
        return ObservationMessage(data=observation_data(payload["observation"], payload["info"], None, False))

    async def step(self, action: TextAction) -> ObservationMessage:
        if self.instance is None:
            raise SessionError(OpenEnvErrorCode.EXECUTION_ERROR, "step before reset: send a reset first")
        if self.instance.instance_id not in self.pool.instances:
            raise SessionError(
                OpenEnvErrorCode.EXECUTION_ERROR,
                f"instance {self.instance.instance_id} was closed for idleness; send a reset",
                reason="instance_expired",
            )
        payload = step_payload(await self.pool.step(self.instance.instance_id, action.text))
        data = observation_data(payload["observation"], payload["info"], payload["reward"], payload["done"])
        return ObservationMessage(data=data)

    def state(self) -> SessionState:
        instance = self.instance
        if instance is None:
            return SessionState(episode_id=self.episode_id)
        return SessionState(
            episode_id=self.episode_id,
            step_count=instance.turns,
            env=instance.env_id,
            instance_id=instance.instance_id,
            seed=instance.seed,
            done=instance.done,
            total_reward=instance.total_reward,
        )

    async def close_instance(self) -> None:
        if self.instance is not None:
            with contextlib.suppress(ApiError):  # already gone: reaped, or the server is stopping
                await self.pool.close(self.instance.instance_id)
            self.instance = None


async def serve_session(websocket: WebSocket, default_env: str | None) -> None:
    """Run one session until the client closes it or disconnects; its instance never outlives it."""
    pool: InstancePool = websocket.app.state.pool
    await websocket.accept()
    session = Session(pool, default_env)
    try:
        while True:
            received = await websocket.receive()
            if received["type"] == "websocket.disconnect":
                return
            raw = received.get("text")
            if raw is None:
                raw = received.get("bytes") or b""
            try:
                answer = await session.handle(raw)
            except SessionError as error:
                answer = error.message()
            if answer is None:
                await websocket.close()
                return
            await websocket.send_text(model_json(answer))
    except WebSocketDisconnect:
        return
    finally:
        await session.close_instance()


@router.websocket("/ws")
async def any_env_session(websocket: WebSocket) -> None:
    await serve_session(websocket, None)


@router.websocket("/{family}/{name}/ws")
async def env_session(websocket: WebSocket, family: str, name: str) -> None:
    env_id = f"{family}/{name}"
    if env_id not in websocket.app.state.pool.env_classes:
        await websocket.accept()
        error = SessionError(
            OpenEnvErrorCode.FACTORY_ERROR, f"no env {env_id!r} on this server; see GET /envs"
        )
        await websocket.send_text(model_json(error.message()))
        await websocket.close(code=1008)
        return
    await serve_session(websocket, env_id)


NO_SUCH_ENV = error_responses(404, descriptions={404: "No env 'family/name' on this server."})


@router.get("/health", response_model=OpenEnvHealth)
async def health() -> OpenEnvHealth:
    return OpenEnvHealth()


@router.get("/{family}/{name}/health", response_model=OpenEnvHealth, responses=NO_SUCH_ENV)
async def env_health(family: str, name: str, pool: PoolDep) -> OpenEnvHealth:
    """Healthy for an env this server has; a 404 for one it has not, as its schema and metadata."""
    _env_class(pool, family, name)
    return OpenEnvHealth()


@router.get("/schema", response_model=Schemas)
async def schemas() -> Schemas:
    return _schemas()


@router.get("/{family}/{name}/schema", response_model=Schemas, responses=NO_SUCH_ENV)
async def env_schemas(family: str, name: str, pool: PoolDep) -> Schemas:
    _env_class(pool, family, name)
    return _schemas()


@router.get("/metadata", response_model=OpenEnvMetadata)
async def metadata(request: Request, pool: PoolDep) -> OpenEnvMetadata:
    families = sorted({cls.family for cls in pool.env_classes.values()})
    return OpenEnvMetadata(
        name=f"stargym ({', '.join(families)})",
        description="Every env of this server; pick one with the reset field 'env': "
        + ", ".join(pool.env_classes),
        version=request.app.version,
    )


@router.get("/{family}/{name}/metadata", response_model=OpenEnvMetadata, responses=NO_SUCH_ENV)
async def env_metadata(request: Request, family: str, name: str, pool: PoolDep) -> OpenEnvMetadata:
    env_class = _env_class(pool, family, name)
    return OpenEnvMetadata(
        name=env_class.env_id(),
        description=f"{env_class.instruction}\n\nAction: {env_class.action_format}",
        version=request.app.version,
    )


def _env_class(pool: InstancePool, family: str, name: str) -> type[Env]:
    env_id = f"{family}/{name}"
    env_class = pool.env_classes.get(env_id)
    if env_class is None:
        raise not_found("env", env_id)
    return env_class


def _schemas() -> Schemas:
    return Schemas(
        action=TextAction.model_json_schema(),
        observation=TextObservation.model_json_schema(),
        state=SessionState.model_json_schema(),
    )
