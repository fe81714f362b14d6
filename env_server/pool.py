"""Live env instances: creation under a limit, one lock each, idle expiry, multi-action turns.

All bookkeeping happens on the event loop, so it needs no thread locks. A trusted env's code
runs in this process (:class:`LocalEnv`): inline for envs that declare ``runs_inline``
(microsecond steps), on worker threads otherwise, so a slow reset of one instance never stalls
steps of others. Any other env's instance lives in a process of its own, killed when a call
overruns (:class:`env_server.sandbox.SandboxedEnv`). Each instance's ``asyncio.Lock``
serialises its own calls: two concurrent steps on one instance never interleave.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from env_server.core import Env, EnvFailure, Observation, Step
from services.contracts import split_actions
from services.errors import ApiError, conflict, not_found, too_many, validation_problems

if TYPE_CHECKING:
    from env_server.sandbox import SandboxHost

T = TypeVar("T")


class HostOptions(BaseModel):
    """Options the host itself handles for every env, taken out before the env sees its own."""

    model_config = ConfigDict(extra="ignore")

    max_actions_per_turn: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Actions per reply, separated by '||' (RAGEN's multi-action turns).",
    )


class EnvRunner(Protocol):
    """Where an instance's env code runs: this process (:class:`LocalEnv`) or a process of its
    own (:class:`env_server.sandbox.SandboxedEnv`). ``env`` is the env object when it is here."""

    inline: bool
    env: Env | None

    async def reset(self, seed: int, options: BaseModel, host_options: HostOptions) -> Observation: ...

    async def play(self, reply: str, host_options: HostOptions) -> Step: ...

    def available_actions(self) -> list[str] | None: ...

    async def close(self) -> None: ...


class LocalEnv:
    """A trusted env in the server's process: on the event loop when it ``runs_inline``, else on
    a worker thread."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.inline = env.runs_inline

    async def reset(self, seed: int, options: BaseModel, host_options: HostOptions) -> Observation:
        return await self._run(lambda: self.env.reset(seed, options))

    async def play(self, reply: str, host_options: HostOptions) -> Step:
        return await self._run(lambda: play_turn(self.env, reply, host_options))

    def available_actions(self) -> list[str] | None:
        return self.env.available_actions()

    async def close(self) -> None:
        await self._run(self.env.close)

    async def _run(self, call: Callable[[], T]) -> T:
        if self.inline:
            return call()
        return await asyncio.to_thread(call)


@dataclass(eq=False)
class Instance:
    """One env with the state the host keeps around it."""

    instance_id: str
    env_id: str
    runner: EnvRunner
    seed: int
    options: dict[str, Any]
    host_options: HostOptions
    observation: str
    created_at: float
    last_used_at: float
    done: bool = False
    turns: int = 0
    total_reward: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def env(self) -> Env | None:
        """The env object, when it lives in this process (a trusted env's)."""
        return self.runner.env

    def touch(self) -> None:
        self.last_used_at = time.time()


class InstancePool:
    """Owns every live instance of one env server."""

    def __init__(
        self,
        env_classes: dict[str, type[Env]],
        max_instances: int,
        ttl_s: float,
        sandbox: SandboxHost | None = None,
    ) -> None:
        self.env_classes = env_classes
        self.max_instances = max_instances
        self.ttl_s = ttl_s
        self.sandbox = sandbox  # its env ids' instances get a process each
        self.instances: dict[str, Instance] = {}
        self._reserved = 0  # creates in flight, counted against the limit before they finish
        self.reaped_total = 0

    def __len__(self) -> int:
        return len(self.instances)

    def get(self, instance_id: str) -> Instance:
        instance = self.instances.get(instance_id)
        if instance is None:
            raise not_found("instance", instance_id)
        return instance

    async def create(
        self, env_id: str, seed: int | None, options: dict[str, Any] | None
    ) -> tuple[Instance, Observation]:
        env_class = self.env_classes.get(env_id)
        if env_class is None:
            raise not_found("env", env_id)
        options = encodable_json(options or {})
        env_options, host_options = parse_options(env_class, options)
        if len(self.instances) + self._reserved >= self.max_instances:
            raise too_many("instance_limit", f"this server holds its limit of {self.max_instances} instances")
        seed = secrets.randbelow(2**31) if seed is None else seed
        self._reserved += 1
        try:
            runner = await self._new_runner(env_id, env_class)
            try:
                first = await runner.reset(seed, env_options, host_options)
            except BaseException as exc:
                await runner.close()
                if isinstance(exc, EnvFailure):
                    raise _failed(env_id, "a new instance", exc) from None
                raise
        finally:
            self._reserved -= 1
        now = time.time()
        instance = Instance(
            instance_id=str(uuid.uuid4()),
            env_id=env_id,
            runner=runner,
            seed=seed,
            options=options,
            host_options=host_options,
            observation=first.observation,
            created_at=now,
            last_used_at=now,
        )
        self.instances[instance.instance_id] = instance
        return instance, first

    async def _new_runner(self, env_id: str, env_class: type[Env]) -> EnvRunner:
        try:
            if self.sandbox is not None and env_id in self.sandbox.env_classes:
                return await self.sandbox.spawn(env_id)
            runner = LocalEnv(env_class())
            try:
                await runner.env.start()
            except BaseException:
                await runner.close()
                raise
            return runner
        except EnvFailure as exc:
            raise _failed(env_id, "a new instance", exc) from None

    async def reset(self, instance_id: str, seed: int | None, options: dict[str, Any] | None) -> Observation:
        instance = self.get(instance_id)
        env_class = self.env_classes[instance.env_id]
        new_options = instance.options if options is None else encodable_json(options)
        env_options, host_options = parse_options(env_class, new_options)
        async with instance.lock:
            self.get(instance_id)  # closed while we waited for the lock?
            seed = instance.seed if seed is None else seed
            observed = await self._call(instance, instance.runner.reset(seed, env_options, host_options))
            instance.seed, instance.options, instance.host_options = seed, new_options, host_options
            instance.observation, instance.done = observed.observation, False
            instance.turns, instance.total_reward = 0, 0.0
            instance.touch()
        return observed

    async def step(self, instance_id: str, action: str) -> Step:
        instance = self.get(instance_id)
        if instance.runner.inline and _uncontended(instance.lock):
            # Nothing below awaits, so no other task can see the lock in between: taking it
            # would change nothing but cost time on the hottest path.
            return self._step_inline(instance, action)
        async with instance.lock:
            self.get(instance_id)
            if instance.done:
                raise _episode_done(instance_id)
            result = await self._call(instance, instance.runner.play(action, instance.host_options))
            _record(instance, result)
        return result

    async def _call(self, instance: Instance, call: Awaitable[T]) -> T:
        """Await a reset or step of ``instance`` (its lock held); an :class:`EnvFailure` closes
        the instance, releasing what it holds, and answers 502 naming the cause."""
        try:
            return await call
        except EnvFailure as exc:
            if self.instances.pop(instance.instance_id, None) is not None:
                await instance.runner.close()
            raise _failed(instance.env_id, f"instance {instance.instance_id}", exc) from None

    def _step_inline(self, instance: Instance, action: str) -> Step:
        if instance.done:
            raise _episode_done(instance.instance_id)
        env = instance.runner.env
        assert env is not None  # an inline runner is a LocalEnv
        result = play_turn(env, action, instance.host_options)
        _record(instance, result)
        return result

    async def step_many(self, requests: list[tuple[str, str]]) -> list[Step | ApiError]:
        """Step many instances in one call; steps of one instance keep their order, others overlap.

        Inline envs whose lock is free are stepped right here, in request order, without a task
        each; the rest (thread-run envs, busy instances) run as one task per instance.
        """
        outcomes: list[Step | ApiError] = [ApiError(500, "internal_error", "not stepped")] * len(requests)
        chains: dict[str, list[int]] = {}
        for index, (instance_id, action) in enumerate(requests):
            chain = chains.get(instance_id)
            if chain is not None:  # an earlier step of this instance waits: keep the order
                chain.append(index)
                continue
            instance = self.instances.get(instance_id)
            if instance is None or not (instance.runner.inline and _uncontended(instance.lock)):
                chains[instance_id] = [index]
                continue
            try:
                outcomes[index] = self._step_inline(instance, action)
            except ApiError as error:
                outcomes[index] = error

        async def run_chain(indices: list[int]) -> None:
            for index in indices:
                instance_id, action = requests[index]
                try:
                    outcomes[index] = await self.step(instance_id, action)
                except ApiError as error:
                    outcomes[index] = error

        if chains:
            await asyncio.gather(*(run_chain(indices) for indices in chains.values()))
        return outcomes

    async def close(self, instance_id: str) -> None:
        instance = self.get(instance_id)
        async with instance.lock:
            if self.instances.pop(instance_id, None) is not None:
                await instance.runner.close()

    async def close_all(self) -> None:
        for instance_id in list(self.instances):
            await self.close(instance_id)

    async def reap_idle(self) -> int:
        """Close instances idle longer than the TTL; busy ones (lock held) are in use, not idle."""
        deadline = time.time() - self.ttl_s
        expired = [i for i in self.instances.values() if i.last_used_at < deadline and not i.lock.locked()]
        for instance in expired:
            if instance.instance_id in self.instances:
                await self.close(instance.instance_id)
        self.reaped_total += len(expired)
        return len(expired)

    async def reap_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.reap_idle()


def parse_options(env_class: type[Env], options: dict[str, Any]) -> tuple[BaseModel, HostOptions]:
    """Split user options into the env's own (validated by its model) and the host's."""
    host_fields = set(HostOptions.model_fields)
    try:
        host_options = HostOptions.model_validate(options)
        env_options = env_class.Options.model_validate(
            {k: v for k, v in options.items() if k not in host_fields}
        )
    except ValidationError as exc:
        raise ApiError(
            422, "invalid_options", f"{env_class.env_id()}: {validation_problems(exc, 'options')}"
        ) from None
    return env_options, host_options


def play_turn(env: Env, reply: str, host_options: HostOptions) -> Step:
    """Carry out one agent reply: up to ``max_actions_per_turn`` actions split on '||'.

    Rewards add up; the episode stops at the first action that ends it; ``info["valid"]`` is
    False if any action was invalid, ``info["actions_executed"]`` says how many ran and
    ``info["invalid_actions"]`` how many of those the env rejected (the worker's share of the
    invalid penalty).
    """
    reply = _encodable(reply)
    if host_options.max_actions_per_turn == 1:
        return env.step(reply)
    actions = split_actions(reply, host_options.max_actions_per_turn) or [""]
    total_reward = 0.0
    invalid = 0
    step = None
    executed = 0
    for action in actions:
        executed += 1
        step = env.step(action)
        total_reward += step.reward
        invalid += not step.info.get("valid", True)
        if step.done:
            break
    assert step is not None
    info = {**step.info, "valid": invalid == 0, "actions_executed": executed, "invalid_actions": invalid}
    return Step(step.observation, total_reward, step.done, info)


def _encodable(text: str) -> str:
    """``text`` with every lone UTF-16 surrogate replaced by ``?``.

    JSON's ``"\\ud800"`` decodes to one, and no encoder takes it: ScienceWorld's JVM, sent such
    an action through py4j, failed and was killed (tests/integration/test_fuzz_steps.py found
    it). No env's valid action holds one, so the env refuses the result as it would have refused
    the action. ASCII, nearly every reply, is passed through after one C-level check.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def encodable_json(value: Any) -> Any:
    """``value`` (parsed JSON) with :func:`_encodable` applied to every string in it, keys too:
    reset options reach the env and are echoed by ``GET /instances`` like actions are."""
    if isinstance(value, str):
        return _encodable(value)
    if isinstance(value, dict):
        return {_encodable(k): encodable_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encodable_json(v) for v in value]
    return value


def _record(instance: Instance, result: Step) -> None:
    instance.observation = result.observation
    instance.done = result.done
    instance.turns += 1
    instance.total_reward += result.reward
    instance.touch()


def _failed(env_id: str, which: str, exc: EnvFailure) -> ApiError:
    return ApiError(502, "env_failed", f"{env_id}: {which} failed and is closed: {exc}")


def _episode_done(instance_id: str) -> ApiError:
    return conflict("episode_done", f"instance {instance_id} finished its episode; reset it first")


def _uncontended(lock: asyncio.Lock) -> bool:
    """Free, with no task queued for it (a queued task would be served before a newcomer)."""
    return not lock.locked() and not getattr(lock, "_waiters", None)
