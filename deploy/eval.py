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

import json
import math
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from deploy.evaluation import EnvResult, EvalError, EvalPlan, run_eval
from services.contracts import parse_family_urls
from services.errors import validation_problems
from services.rollout_protocol import ActionFormat, SamplingParams

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
        typer.Option(help="plain, words or answer_tags; default: plain, answer_tags with --openai-base-url."),
    ] = None,
    history_turns: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Earlier turns each prompt keeps (as the policy was trained with rollout.history_turns); "
            "0: the instruction and the current observation only. Default: the whole episode.",
        ),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help="With --openai-base-url: a system message before the episode.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Trajectories JSONL; default runs/eval-<timestamp>/trajectories.jsonl."),
    ] = None,
    options: Annotated[
        str | None,
        typer.Option(
            help='Env options of every --env as JSON, e.g. \'{"split": "test"}\'; default: each env\'s.'
        ),
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
            history_turns=history_turns,
            system_prompt=system_prompt,
            out=out,
            options=options,
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
    options: str | None = None,
    history_turns: int | None = None,
) -> EvalPlan:
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
    try:
        env_urls = parse_family_urls(list(env_url)) if env_url else {}
    except ValueError as exc:
        raise EvalError(f"--env-url: {exc}") from None
    _check_registered(env_ids, env_urls)
    env_options = _parse_options(options, env_ids, env_urls)

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
        raise EvalError(f"bad sampling settings: {validation_problems(exc, 'sampling')}") from None
    if out is None:
        out = Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}" / "trajectories.jsonl"
    config = EvalPlan(
        envs=env_ids,
        episodes=episodes,
        max_turns=max_turns,
        sampling=sampling_params,
        seed=seed,
        concurrency=concurrency,
        out=out,
        env_urls=env_urls,
        action_format=cast(ActionFormat | None, action_format),
        history_turns=history_turns,
        system_prompt=system_prompt,
        engine_max_num_seqs=max(64, concurrency),
        options=env_options,
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


def _check_registered(env_ids: list[str], env_urls: dict[str, str]) -> None:
    """Envs whose server this run starts must be registered here; the others are checked remotely."""
    from env_server.registry import registered_ids

    registered = registered_ids()
    for env_id in env_ids:
        if env_id.split("/", 1)[0] not in env_urls and env_id not in registered:
            raise EvalError(f"unknown env {env_id!r}; registered envs: {', '.join(registered)}")


def _parse_options(
    text: str | None, env_ids: list[str], env_urls: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """``--options``: a JSON object, checked against the options model of every env this run serves
    itself (a given server checks its envs' options and refuses bad ones with a 422); by env id."""
    if text is None:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvalError(f"--options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise EvalError(
            f'--options must be a JSON object of env options, e.g. \'{{"split": "test"}}\', not {text!r}'
        )
    from env_server.registry import ENTRY_POINT_GROUP, load_env_path

    registered = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for env_id in env_ids:
        if env_id.split("/", 1)[0] in env_urls or env_id not in registered:
            continue
        try:
            load_env_path(registered[env_id]).Options.model_validate(options)
        except ValidationError as exc:
            raise EvalError(f"--options for {env_id}: {validation_problems(exc, 'options')}") from None
    return dict.fromkeys(env_ids, options)


# -- reporting --------------------------------------------------------------------------------


def results_table(results: list[EnvResult], config: EvalPlan) -> Table:
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
