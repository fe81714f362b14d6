"""``stargym model init``: make the tiny default policy from the texts of the envs it is for.

The env classes run in-process (deploy may import everything): each is reset over a range of
seeds and played with random available actions, which collects instructions, observations and
actions as the env really prints them. Envs are found through the registry, so a newly
registered env is picked up without touching this file. Env-specific knowledge stays out: an env
whose action space is open text (``available_actions()`` is None, e.g. TextCraft) is played with
random lines of its observation, which for TextCraft are its crafting commands.
"""

from __future__ import annotations

import random
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import typer

from env_server.core import Env
from env_server.pool import parse_options
from env_server.registry import ENTRY_POINT_GROUP, EnvLoadError, load_env_path, load_family

DEFAULT_FAMILY = "game"
# An action no env accepts: its refusal message is text the policy will see often.
INVALID_ACTION = "invalid"


def resolve_envs(names: list[str]) -> dict[str, type[Env]]:
    """Env classes by id: registered ids (``game/sokoban``), whole families (``game``) or class paths."""
    registered = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    classes: dict[str, type[Env]] = {}
    for name in names:
        if name in registered or ":" in name:
            env_class = load_env_path(registered.get(name, name))
            classes[env_class.env_id()] = env_class
        else:
            classes.update(load_family(name))
    return dict(sorted(classes.items()))


def collect_env_texts(
    env_classes: dict[str, type[Env]],
    episodes: int,
    max_steps: int,
    options_by_env: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[str], list[str]]:
    """Texts (instructions, action formats, observations) and actions, in a deterministic order.

    Every episode is seeded (env and action choice alike), so the same envs give the same texts.
    Half the episodes start with an invalid action, so refusal messages are in the corpus too.
    Each env plays ``episodes`` seeds of its options in ``options_by_env`` (a run's mix: the
    vocabulary of what it trains on), else of each of its ``vocabulary_options``.
    """
    texts: list[str] = []
    actions: set[str] = set()
    for env_id, env_class in env_classes.items():
        texts += [env_class.instruction, env_class.action_format]
        actions.update(env_class.vocabulary_actions)
        option_sets = (
            [options_by_env[env_id]]
            if options_by_env and env_id in options_by_env
            else env_class.vocabulary_options
        )
        plays = [  # the env's own options: a run's mix may hold the host's (max_actions_per_turn)
            (parse_options(env_class, options)[0], seed)
            for options in option_sets
            for seed in range(episodes)
        ]
        for options, seed in plays:
            rng = random.Random(seed)
            env = env_class()
            try:
                observation = env.reset(seed, options).observation
                texts.append(observation)
                if seed % 2:
                    texts.append(env.step(INVALID_ACTION).observation)
                for _ in range(min(max_steps, env_class.default_max_turns)):
                    available = env.available_actions()
                    if available:
                        actions.update(available)
                        action = rng.choice(sorted(available))
                    else:
                        lines = [line for line in observation.splitlines() if line.strip()]
                        action = rng.choice(lines) if lines else INVALID_ACTION
                    step = env.step(action)
                    texts.append(step.observation)
                    if step.done:
                        break
            finally:
                env.close()
    return texts, sorted(actions)


def init_tiny_model(
    out: Path,
    seed: int,
    env_names: list[str],
    episodes: int,
    max_steps: int,
    options_by_env: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Collect the named envs' texts and write the tiny policy to ``out``; what the command runs."""
    texts, actions = collect_env_texts(resolve_envs(env_names), episodes, max_steps, options_by_env)
    # torch and transformers load here, not at import: every `stargym` command imports this module.
    from deploy.tiny_model import create_tiny_policy

    return create_tiny_policy(texts, actions, out, seed)


def model_init_command(
    out: Annotated[Path, typer.Option(help="Directory to write (replaced if it exists).")] = Path(
        "models/tiny"
    ),
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    envs: Annotated[
        str,
        typer.Option(help="Comma-separated env ids or families the vocabulary is built from."),
    ] = DEFAULT_FAMILY,
    episodes: Annotated[int, typer.Option(min=1, help="Seeds played per env to collect its texts.")] = 100,
    max_steps: Annotated[int, typer.Option(min=0, help="Most random steps per episode.")] = 20,
) -> None:
    """Create the tiny default policy (Qwen2 architecture, local tokenizer) in Hugging Face layout."""
    names = [name.strip() for name in envs.split(",") if name.strip()]
    try:
        path = init_tiny_model(out, seed, names, episodes, max_steps)
    except EnvLoadError as exc:
        raise typer.BadParameter(str(exc), param_hint="--envs") from None
    typer.echo(f"wrote {path} from {', '.join(names)}")
