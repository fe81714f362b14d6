"""The ``stargym eval`` runner: start what is missing, play every episode, aggregate and write.

:func:`run_eval` takes a checked :class:`EvalPlan` (built by the command line, :mod:`deploy.eval`,
or by ``deploy.demo``) and returns one :class:`EnvResult` per env; the trajectories go to
``plan.out`` (JSONL) and the numbers to ``<out stem>.summary.json`` beside it.

Three engines, exactly one per run: a model directory served by a CPU engine started for the
run; running engine-protocol servers (the tokenizer from ``--tokenizer`` or the model directory
they report); an OpenAI-compatible chat endpoint (text-only trajectories). A family without a
given env server gets one started likewise. Episode ``i`` of an env uses env seed ``seed + i``
and sampling seed ``seed + i``, so a run reproduces. An episode that fails (env or engine error)
is kept with ``error`` set and counts as a failure in every rate. Given servers behind a bearer
token get the rollout worker's tokens: ``STARGYM_ROLLOUT_ENGINE_API_TOKEN``,
``STARGYM_ROLLOUT_ENV_API_TOKEN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from deploy.launcher import ServiceProcess, concurrent_starts, free_port
from services.rollout_protocol import ActionFormat, RolloutJob, SamplingParams, Trajectory

WORKER_ID = "eval"
ENGINE_TOKEN_VAR = "STARGYM_ROLLOUT_ENGINE_API_TOKEN"
ENV_TOKEN_VAR = "STARGYM_ROLLOUT_ENV_API_TOKEN"
LOG_TAIL_LINES = 20


class EvalError(Exception):
    """Bad input, or a service that cannot be reached or started: one line for the user."""


@dataclass
class EvalPlan:
    """What one ``stargym eval`` run does, validated."""

    envs: list[str]
    episodes: int
    max_turns: int | None
    sampling: SamplingParams
    seed: int
    concurrency: int
    out: Path
    env_urls: dict[str, str] = field(default_factory=dict)
    model: Path | None = None
    engine_urls: list[str] = field(default_factory=list)
    tokenizer: Path | None = None
    openai_base_url: str | None = None
    openai_model: str | None = None
    api_key: str | None = None
    action_format: ActionFormat | None = None
    history_turns: int | None = None
    system_prompt: str | None = None
    engine_max_num_seqs: int = 64
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # env id -> its episodes' options

    @property
    def families(self) -> list[str]:
        return sorted({env.split("/", 1)[0] for env in self.envs})

    @property
    def log_dir(self) -> Path:
        return self.out.parent / "logs"


@dataclass
class EnvResult:
    """The aggregate of one env's trajectories."""

    env: str
    episodes: int = 0
    successes: int = 0
    total_return: float = 0.0
    total_turns: int = 0
    invalid_turns: int = 0
    truncated: int = 0
    errors: int = 0
    first_error: str | None = None

    def add(self, trajectory: Trajectory) -> None:
        self.episodes += 1
        self.successes += trajectory.success
        self.total_return += trajectory.reward
        self.total_turns += trajectory.num_turns
        self.invalid_turns += sum(not turn.valid for turn in trajectory.turns)
        self.truncated += trajectory.truncated
        if trajectory.error is not None:
            self.errors += 1
            self.first_error = self.first_error or trajectory.error

    def summary(self) -> dict[str, Any]:
        n = max(self.episodes, 1)
        return {
            "env": self.env,
            "episodes": self.episodes,
            "success_rate": self.successes / n,
            "mean_return": self.total_return / n,
            "mean_turns": self.total_turns / n,
            "invalid_action_rate": self.invalid_turns / self.total_turns if self.total_turns else 0.0,
            "truncated_rate": self.truncated / n,
            "errors": self.errors,
        }


def run_eval(config: EvalPlan, err: Console | None = None) -> list[EnvResult]:
    """Start what is missing, check what is given, play every episode; stop what was started."""
    err = err or Console(stderr=True)
    with contextlib.ExitStack() as stack:
        # Given services are checked before anything is started: a wrong URL fails in a second.
        asyncio.run(_check_engine(config))
        env_urls = dict(config.env_urls)
        missing = [family for family in config.families if family not in env_urls]
        started = _start_services(config, missing, err, stack)
        env_urls.update({family: started[family].url for family in missing})
        if config.model is not None:
            config.engine_urls = [started["engine"].url]
            config.tokenizer = config.model
        config.out.parent.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_play(config, env_urls, err))


def _start_services(
    config: EvalPlan, families: list[str], err: Console, stack: contextlib.ExitStack
) -> dict[str, ServiceProcess]:
    """Env servers for ``families`` and, with ``--model``, a CPU engine, started in parallel."""
    wanted: dict[str, list[str]] = {family: ["env", "serve", family] for family in families}
    if config.model is not None:
        wanted["engine"] = [
            "engine", "serve", "--model", str(config.model), "--max-num-seqs", str(config.engine_max_num_seqs)
        ]  # fmt: skip
    if not wanted:
        return {}
    err.print(f"starting {', '.join(wanted)} (logs in {config.log_dir})", highlight=False)

    processes: list[ServiceProcess] = []
    try:
        with concurrent_starts(processes) as start:
            futures = {
                name: start(
                    name, lambda port, args=args: [*args, "--port", str(port)], free_port, config.log_dir
                )
                for name, args in wanted.items()
            }
    finally:
        for process in processes:  # every one that started, whether or not another failed
            stack.callback(process.stop)
    started: dict[str, ServiceProcess] = {}
    failures: list[str] = []
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except RuntimeError as exc:
            failures.append(_short_start_error(name, str(exc)))
    if failures:
        raise EvalError("; ".join(failures))
    return started


def _short_start_error(name: str, message: str) -> str:
    head, _, log = message.partition("\n--- log ---\n")
    tail = "\n".join(log.strip().splitlines()[-LOG_TAIL_LINES:])
    return f"{head}" + (f"\n{tail}" if tail else "")


async def _check_engine(config: EvalPlan) -> None:
    """A given engine must answer now (and an OpenAI endpoint accept the key)."""
    from rollout_server.openai_chat import OpenAIAuthError, OpenAIChatClient
    from services.engine_client import EngineClient, EngineClientError, EngineServerError

    if config.engine_urls:
        async with EngineClient(
            config.engine_urls, token=_token(ENGINE_TOKEN_VAR), timeout=30.0, retries=2
        ) as engine:
            try:
                await engine.health()
            except EngineClientError as exc:
                raise EvalError(f"cannot reach the engine: {exc}") from None
    elif config.openai_base_url is not None:
        assert config.openai_model is not None
        async with OpenAIChatClient(
            config.openai_base_url, config.openai_model, config.api_key, timeout=30.0, retries=2
        ) as client:
            try:
                served = await client.models()
            except OpenAIAuthError as exc:
                raise EvalError(f"{config.openai_base_url} refused the API key: {exc.message}") from None
            except EngineServerError as exc:
                if exc.status != 404:  # an endpoint without /models is fine
                    raise EvalError(f"{config.openai_base_url}/models failed: {exc}") from None
                served = []
            except EngineClientError as exc:
                raise EvalError(f"cannot reach {config.openai_base_url}: {exc}") from None
            if served and config.openai_model not in served:
                raise EvalError(
                    f"{config.openai_base_url} does not serve {config.openai_model!r}; it serves: "
                    f"{', '.join(served[:20])}"
                )


def make_jobs(config: EvalPlan, max_turns: dict[str, int], run_id: str) -> list[RolloutJob]:
    """Episode i of every env in turn (seed + i), so every env progresses from the start."""
    return [
        RolloutJob(
            run_id=run_id,
            env=env,
            seed=config.seed + index,
            group_id=f"{env}:{config.seed + index}",
            max_turns=max_turns[env],
            sampling=config.sampling.model_copy(update={"seed": config.seed + index}),
            policy_version=0,
            action_format=config.action_format or ("answer_tags" if config.openai_base_url else "plain"),
            history_turns=config.history_turns,
            options=config.options.get(env),
        )
        for index in range(config.episodes)
        for env in config.envs
    ]


async def _play(config: EvalPlan, env_urls: dict[str, str], err: Console) -> list[EnvResult]:
    from services.env_client import EnvClient, EnvClientError

    async with contextlib.AsyncExitStack() as stack:
        clients = {
            family: await stack.enter_async_context(EnvClient(url, _token(ENV_TOKEN_VAR), timeout=120.0))
            for family, url in env_urls.items()
            if family in config.families
        }
        specs = {}
        for family, client in clients.items():
            try:
                served = await client.list_envs()
            except EnvClientError as exc:
                raise EvalError(f"cannot reach the {family} env server at {client.base_url}: {exc}") from None
            specs.update({spec.id: spec for spec in served})
            for env_id in config.envs:
                if env_id.split("/", 1)[0] == family and env_id not in specs:
                    raise EvalError(
                        f"unknown env {env_id!r}; {client.base_url} serves: {', '.join(s.id for s in served)}"
                    )
        play = await _episode_player(config, stack)
        text_only = config.openai_base_url is not None
        run_id = f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
        max_turns = {env: config.max_turns or specs[env].default_max_turns for env in config.envs}
        jobs = make_jobs(config, max_turns, run_id)
        results = {env: EnvResult(env) for env in config.envs}
        gate = asyncio.Semaphore(config.concurrency)
        width = max(len(env) for env in config.envs)
        with (
            config.out.open("w") as sink,
            Progress(
                TextColumn(f"{{task.description:<{width}}}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("success {task.fields[success]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=err,
            ) as progress,
        ):
            tasks = {env: progress.add_task(env, total=config.episodes, success=0) for env in config.envs}

            async def one(job: RolloutJob) -> None:
                async with gate:
                    envs = clients[job.env.split("/", 1)[0]]
                    trajectory = await _play_one(job, envs, specs, play, text_only)
                sink.write(trajectory.model_dump_json() + "\n")
                sink.flush()
                result = results[job.env]
                result.add(trajectory)
                progress.update(tasks[job.env], advance=1, success=result.successes)

            await asyncio.gather(*(one(job) for job in jobs))
    write_summary(config, list(results.values()))
    return list(results.values())


async def _episode_player(config: EvalPlan, stack: contextlib.AsyncExitStack) -> Any:
    """``play(job, envs, instruction) -> Trajectory`` for the configured engine."""
    if config.openai_base_url is not None:
        from rollout_server.openai_chat import OpenAIChatClient, run_chat_episode

        assert config.openai_model is not None
        chat = await stack.enter_async_context(
            OpenAIChatClient(config.openai_base_url, config.openai_model, config.api_key)
        )

        async def play_chat(job: RolloutJob, envs: Any, instruction: str) -> Trajectory:
            return await run_chat_episode(
                job, envs, chat, instruction, system_prompt=config.system_prompt, worker_id=WORKER_ID
            )

        return play_chat

    from rollout_server.episode import run_episode
    from services.engine_client import EngineClient, EngineClientError

    engine = await stack.enter_async_context(
        EngineClient(config.engine_urls, token=_token(ENGINE_TOKEN_VAR), timeout=600.0)
    )
    try:
        max_model_len = await engine.max_model_len()
        tokenizer_dir = config.tokenizer or await engine.served_model_dir()
    except EngineClientError as exc:
        raise EvalError(f"cannot reach the engine: {exc}") from None
    if tokenizer_dir is None:
        raise EvalError("the engine does not report a local model directory: pass --tokenizer DIR")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise EvalError(f"cannot load the tokenizer from {tokenizer_dir}: {exc}") from None

    async def play_tokens(job: RolloutJob, envs: Any, instruction: str) -> Trajectory:
        return await run_episode(
            job, envs, engine, tokenizer, instruction, 0, max_model_len=max_model_len, worker_id=WORKER_ID
        )

    return play_tokens


def _token(variable: str) -> str | None:
    """A bearer token from the environment, as the rollout worker reads it; None when unset."""
    return os.environ.get(variable) or None


async def _play_one(
    job: RolloutJob, envs: Any, specs: dict[str, Any], play: Any, text_only: bool
) -> Trajectory:
    """One episode; a failure becomes a trajectory with ``error`` set (and no turns)."""
    try:
        return await play(job, envs, specs[job.env].instruction)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # recorded and counted, never fatal to the run
        return Trajectory.from_job(
            job,
            worker_id=WORKER_ID,
            error=f"{type(exc).__name__}: {exc}",
            text_only=text_only,
        )


def write_summary(config: EvalPlan, results: list[EnvResult]) -> Path:
    """``<out stem>.summary.json`` beside the trajectories: the table's numbers and the settings."""
    path = config.out.with_name(config.out.stem + ".summary.json")
    summary = {
        "engine": {
            "model": str(config.model) if config.model else None,
            "engine_urls": None if config.model else config.engine_urls or None,
            "openai_base_url": config.openai_base_url,
            "openai_model": config.openai_model,
        },
        "sampling": config.sampling.model_dump(),
        "seed": config.seed,
        "episodes": config.episodes,
        "max_turns": config.max_turns,
        "trajectories": str(config.out),
        "envs": [result.summary() for result in results],
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
