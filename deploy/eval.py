"""``stargym eval``: score a policy on envs, with a progress bar, a table per env and the trajectories.

    stargym eval --env game/sokoban --model models/tiny --episodes 256 --max-turns 10
    stargym eval --env game/frozenlake --engine-url http://127.0.0.1:8210 --tokenizer models/tiny
    stargym eval --env game/sokoban --openai-base-url https://api.openai.com/v1 --openai-model gpt-4o

Three engines, exactly one per run:

* ``--model DIR``: our CPU engine serving DIR, started on a free port for this run and stopped
  after it (its log under the output directory); token-level episodes, as in training.
* ``--engine-url URL[,URL]``: running servers of the engine protocol (our CPU engine, vLLM);
  the tokenizer is ``--tokenizer DIR``, or the model directory the first server reports.
* ``--openai-base-url URL --openai-model NAME``: any OpenAI-compatible chat endpoint, the key
  read from the variable ``--api-key-env`` names; text-only trajectories
  (:mod:`rollout_server.openai_chat`), asked for ``answer_tags`` replies unless
  ``--action-format`` says otherwise.

A family with no ``--env-url FAMILY=URL`` gets its env server started likewise. Episode ``i`` of
an env uses env seed ``seed + i`` and sampling seed ``seed + i``, so a run reproduces. An episode
that fails (env or engine error) is kept with ``error`` set and counts as a failure in every
rate; the run exits 1 only when every episode failed. Bad input and unreachable services exit
with one line on stderr and no traceback. Given servers behind a bearer token get the rollout
worker's tokens: ``STARGYM_ROLLOUT_ENGINE_API_TOKEN``, ``STARGYM_ROLLOUT_ENV_API_TOKEN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from deploy.launcher import ServiceProcess, free_port, start_service
from services.rollout_protocol import ActionFormat, RolloutJob, SamplingParams, Trajectory

WORKER_ID = "eval"
ENGINE_TOKEN_VAR = "STARGYM_ROLLOUT_ENGINE_API_TOKEN"
ENV_TOKEN_VAR = "STARGYM_ROLLOUT_ENV_API_TOKEN"
LOG_TAIL_LINES = 20


class EvalError(Exception):
    """Bad input, or a service that cannot be reached or started: one line for the user."""


@dataclass
class EvalConfig:
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
    system_prompt: str | None = None
    engine_max_num_seqs: int = 64

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


# -- the command ------------------------------------------------------------------------------


def eval_command(
    env: Annotated[
        list[str],
        typer.Option("--env", help="Env id to evaluate, e.g. game/sokoban; repeat or comma-separate."),
    ],
    model: Annotated[
        Path | None, typer.Option(help="Model directory: served by a CPU engine started for this run.")
    ] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(help="Running engine-protocol server(s) (CPU engine, vLLM), comma-separated."),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="With --engine-url: tokenizer directory; default: the model the server reports."),
    ] = None,
    openai_base_url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible API, e.g. https://api.openai.com/v1.")
    ] = None,
    openai_model: Annotated[str | None, typer.Option(help="Model name for --openai-base-url.")] = None,
    api_key_env: Annotated[
        str, typer.Option(help="Environment variable holding the API key for --openai-base-url.")
    ] = "OPENAI_API_KEY",
    episodes: Annotated[int, typer.Option(min=1, help="Episodes per env.")] = 256,
    max_turns: Annotated[
        int | None, typer.Option(min=1, help="Turns per episode; default: each env's own.")
    ] = None,
    env_url: Annotated[
        list[str] | None,
        typer.Option(help="FAMILY=URL of a running env server; families without one are started here."),
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes played at once.")] = 32,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per reply (per turn).")] = 256,
    seed: Annotated[int, typer.Option(min=0, help="Episode i uses env and sampling seed seed+i.")] = 0,
    action_format: Annotated[
        str | None,
        typer.Option(help="plain or answer_tags; default: plain, answer_tags with --openai-base-url."),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help="With --openai-base-url: a system message before the episode.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Trajectories JSONL; default runs/eval-<timestamp>/trajectories.jsonl."),
    ] = None,
) -> None:
    """Play episodes of each env with a policy; print a table per env and write the trajectories."""
    err = Console(stderr=True)
    try:
        config = build_config(
            envs=env,
            model=model,
            engine_url=engine_url,
            tokenizer=tokenizer,
            openai_base_url=openai_base_url,
            openai_model=openai_model,
            api_key_env=api_key_env,
            episodes=episodes,
            max_turns=max_turns,
            env_url=env_url or [],
            concurrency=concurrency,
            sampling={"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens},
            seed=seed,
            action_format=action_format,
            system_prompt=system_prompt,
            out=out,
        )
        results = run_eval(config, err)
    except EvalError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
    console = Console()
    if not console.is_terminal:  # a pipe or a file gets the whole table, not 80 columns of it
        console = Console(width=160)
    console.print(results_table(results, config))
    console.print(f"trajectories: {config.out}", highlight=False, soft_wrap=True)
    if all(result.errors == result.episodes for result in results):
        first = next((r.first_error for r in results if r.first_error), "")
        err.print(f"[bold red]error:[/] every episode failed; the first: {first}", soft_wrap=True)
        raise typer.Exit(1)


def build_config(
    *,
    envs: Sequence[str],
    model: Path | None,
    engine_url: str | None,
    tokenizer: Path | None,
    openai_base_url: str | None,
    openai_model: str | None,
    api_key_env: str,
    episodes: int,
    max_turns: int | None,
    env_url: Sequence[str],
    concurrency: int,
    sampling: dict[str, Any],
    seed: int,
    action_format: str | None,
    system_prompt: str | None,
    out: Path | None,
) -> EvalConfig:
    """Check the flags (nothing is started or contacted here); :class:`EvalError` says what is wrong."""
    from rollout_server.actions import ACTION_FORMATS
    from rollout_server.openai_chat import MissingAPIKeyError, api_key_from_env, normalise_base_url

    env_ids = list(dict.fromkeys(item.strip() for value in envs for item in value.split(",") if item.strip()))
    if not env_ids:
        raise EvalError("name at least one env with --env, e.g. --env game/sokoban")
    for env_id in env_ids:
        family, _, name = env_id.partition("/")
        if not family or not name:
            raise EvalError(f"unknown env {env_id!r}: env ids look like 'family/name', e.g. game/sokoban")
    env_urls = _parse_env_urls(env_url)
    _check_registered(env_ids, env_urls)

    modes = [flag for flag, value in (("--model", model), ("--engine-url", engine_url)) if value]
    if openai_base_url or openai_model:
        modes.append("--openai-base-url")
    if len(modes) != 1:
        given = f" (given: {', '.join(modes)})" if modes else ""
        raise EvalError(
            f"choose exactly one engine: --model DIR, --engine-url URL, or --openai-base-url URL "
            f"--openai-model NAME{given}"
        )
    if action_format is not None and action_format not in ACTION_FORMATS:
        raise EvalError(f"unknown action format {action_format!r}; known: {', '.join(ACTION_FORMATS)}")
    try:
        sampling_params = SamplingParams(**sampling)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise EvalError(f"bad sampling settings: {problems}") from None
    if out is None:
        out = Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}" / "trajectories.jsonl"
    config = EvalConfig(
        envs=env_ids,
        episodes=episodes,
        max_turns=max_turns,
        sampling=sampling_params,
        seed=seed,
        concurrency=concurrency,
        out=out,
        env_urls=env_urls,
        action_format=cast(ActionFormat | None, action_format),
        system_prompt=system_prompt,
        engine_max_num_seqs=max(64, concurrency),
    )
    if model is not None:
        if not (model / "config.json").is_file():
            raise EvalError(f"--model {model}: not a Hugging Face model directory (no config.json)")
        config.model = model.resolve()
    elif engine_url:
        urls = [url.strip().rstrip("/") for url in engine_url.split(",") if url.strip()]
        bad = [url for url in urls if not url.startswith(("http://", "https://"))]
        if not urls or bad:
            raise EvalError(f"--engine-url: {', '.join(bad) or 'nothing'} is not an http(s) URL")
        config.engine_urls = urls
        if tokenizer is not None and not tokenizer.is_dir():
            raise EvalError(f"--tokenizer {tokenizer}: not a directory")
        config.tokenizer = tokenizer
    else:
        if not openai_base_url or not openai_model:
            raise EvalError("--openai-base-url and --openai-model go together")
        try:
            config.openai_base_url = normalise_base_url(openai_base_url)
            config.api_key = api_key_from_env(api_key_env)
        except (ValueError, MissingAPIKeyError) as exc:
            raise EvalError(str(exc)) from None
        config.openai_model = openai_model
    if system_prompt is not None and config.openai_base_url is None:
        raise EvalError("--system-prompt applies to --openai-base-url only")
    return config


def _parse_env_urls(values: Sequence[str]) -> dict[str, str]:
    urls: dict[str, str] = {}
    for item in (item.strip() for value in values for item in value.split(",")):
        if not item:
            continue
        family, sep, url = item.partition("=")
        family, url = family.strip(), url.strip().rstrip("/")
        if not sep or not family or "/" in family or not url.startswith(("http://", "https://")):
            raise EvalError(f"--env-url {item!r} must be FAMILY=URL, e.g. game=http://127.0.0.1:8101")
        if family in urls:
            raise EvalError(f"--env-url names family {family!r} twice")
        urls[family] = url
    return urls


def _check_registered(env_ids: list[str], env_urls: dict[str, str]) -> None:
    """Envs whose server this run starts must be registered here; the others are checked remotely."""
    from env_server.registry import registered_ids

    registered = registered_ids()
    for env_id in env_ids:
        if env_id.split("/", 1)[0] not in env_urls and env_id not in registered:
            raise EvalError(f"unknown env {env_id!r}; registered envs: {', '.join(registered)}")


# -- running ----------------------------------------------------------------------------------


def run_eval(config: EvalConfig, err: Console | None = None) -> list[EnvResult]:
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
    config: EvalConfig, families: list[str], err: Console, stack: contextlib.ExitStack
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

    def start(name: str) -> ServiceProcess:
        port = free_port()
        return start_service(name, [*wanted[name], "--port", str(port)], port, config.log_dir)

    started: dict[str, ServiceProcess] = {}
    failures: list[str] = []
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {name: pool.submit(start, name) for name in wanted}
        for name, future in futures.items():
            try:
                started[name] = future.result()
                stack.callback(started[name].stop)
            except RuntimeError as exc:
                failures.append(_short_start_error(name, str(exc)))
    if failures:
        raise EvalError("; ".join(failures))
    return started


def _short_start_error(name: str, message: str) -> str:
    head, _, log = message.partition("\n--- log ---\n")
    tail = "\n".join(log.strip().splitlines()[-LOG_TAIL_LINES:])
    return f"{head}" + (f"\n{tail}" if tail else "")


async def _check_engine(config: EvalConfig) -> None:
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


def make_jobs(config: EvalConfig, max_turns: dict[str, int], run_id: str) -> list[RolloutJob]:
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
        )
        for index in range(config.episodes)
        for env in config.envs
    ]


async def _play(config: EvalConfig, env_urls: dict[str, str], err: Console) -> list[EnvResult]:
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


async def _episode_player(config: EvalConfig, stack: contextlib.AsyncExitStack) -> Any:
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
        tokenizer_dir = config.tokenizer or _reported_model_dir(await engine.models())
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


def _reported_model_dir(models: dict[str, list[dict[str, Any]]]) -> Path | None:
    for cards in models.values():
        for card in cards:
            for key in ("root", "id"):
                value = card.get(key)
                if value and (Path(value) / "tokenizer_config.json").is_file():
                    return Path(value)
    return None


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


# -- reporting --------------------------------------------------------------------------------


def results_table(results: list[EnvResult], config: EvalConfig) -> Table:
    engine = (
        f"{config.openai_model} @ {config.openai_base_url}"
        if config.openai_base_url
        else str(config.model or ",".join(config.engine_urls))
    )
    table = Table(
        title=f"stargym eval: {engine}",
        caption=f"temperature {config.sampling.temperature}, seeds {config.seed}.."
        f"{config.seed + config.episodes - 1}; a failed episode counts as unsuccessful",
    )
    for column in ("env", "episodes", "success", "mean return", "mean turns", "invalid actions", "truncated"):
        table.add_column(column, justify="left" if column == "env" else "right")
    table.add_column("errors", justify="right")
    for result in results:
        row = result.summary()
        table.add_row(
            result.env,
            str(row["episodes"]),
            _percent(row["success_rate"]),
            f"{row['mean_return']:.3f}",
            f"{row['mean_turns']:.2f}",
            _percent(row["invalid_action_rate"]),
            _percent(row["truncated_rate"]),
            str(row["errors"]),
        )
    return table


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def write_summary(config: EvalConfig, results: list[EnvResult]) -> Path:
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
