"""The hosted games' env classes, made from the rows of games.py: ``textarena/<game>`` each.

The classes are module attributes (``TextArenaTowerOfHanoiEnv``…) so that pyproject's entry points
name them like any hand-written env class; ENV_CLASSES maps env ids to them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model

from env_server.envs.textarena.env import TextArenaEnv, TextArenaOptions
from env_server.envs.textarena.games import GAMES, Game
from env_server.envs.textarena.variants import variants_of

INSTRUCTION = (
    "You are playing {title}, a single-player game from TextArena. Its first messages give the rules "
    "and the starting position; after each move it tells you what changed. {hint}An invalid move is "
    "answered with a warning; a second invalid move in a row ends the game. The game is scored only "
    "when it ends, a win scoring 1. Reply with one move in square brackets, e.g. '{example}'."
)


def env_class(game: Game) -> type[TextArenaEnv]:
    """The env class of one hosted game, its Options accepting exactly the game's TextArena variants."""
    class_name = "TextArena" + "".join(part.capitalize() for part in game.name.split("_")) + "Env"
    variants = variants_of(game.variant)
    options = create_model(
        class_name.removesuffix("Env") + "Options",
        __base__=TextArenaOptions,
        __module__=__name__,
        variant=(
            Literal[variants],
            Field(
                default=game.variant, description=f"The TextArena id to play: one of {', '.join(variants)}."
            ),
        ),
    )
    hint = f"{game.hint} " if game.hint else ""
    attributes = {
        "__module__": __name__,
        "__qualname__": class_name,
        "__doc__": f"TextArena's {game.title} ({game.variant} and its variants).",
        "game": game,
        "name": game.name,
        "instruction": INSTRUCTION.format(title=game.title, hint=hint, example=game.example),
        "action_format": f"one move in square brackets, e.g. '{game.example}'",
        "default_max_turns": game.max_turns,
        "reward_range": game.reward_range,
        "Options": options,
    }
    return type(class_name, (TextArenaEnv,), attributes)


ENV_CLASSES: dict[str, type[TextArenaEnv]] = {cls.env_id(): cls for cls in map(env_class, GAMES)}
globals().update({cls.__name__: cls for cls in ENV_CLASSES.values()})
