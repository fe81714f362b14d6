"""One TextArena game as a stargym env: the class every hosted game's class derives from.

Each reset makes a fresh TextArena env of the chosen variant (its ``-raw`` id: no wrappers), so an
episode never depends on the one before it. Moves get TextArena's ActionFormattingWrapper rule
(brackets added when a reply has none: every hosted variant's default id applies it), so "up" and
"[up]" are the same move here as there.

Invalid moves follow TextArena's own judgement: the first one is answered with a warning and the
game goes on, a second in a row ends it (Minesweeper counts a mine hit as one). Both are steps with
``info["valid"] = False``. TextArena scores a game only when it ends: that reward is the last step's
and earlier steps score 0; ``info["success"]`` says whether it was a win (reward 1). An exception
inside TextArena's code is a bug of the game, not of the move: it is an :class:`EnvFailure`, so the
host closes the instance with its message (LightsOut's reset divides by zero for about one seed in
5,000: 4 of seeds 0–19,999, the first 10,067).

``runs_inline`` is False for the whole family. Measured here (2 shared cores, median): a step costs
55–190 µs (Minesweeper's 1 ms) and most resets 0.1–6 ms, but Set's reset takes 34 ms, RushHour's
250 ms and Sokoban's 610 ms (their generators retry until a puzzle passes; up to 0.85 s). Since
every call takes the process-wide lock of :mod:`.randomness`, an inline call on the event loop would
stall the whole server while a worker thread holds that lock for such a reset.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import textarena as ta
from pydantic import BaseModel, ConfigDict

from env_server.core import Env, EnvFailure, Observation, Step
from env_server.envs.textarena.fixes import WIN_REWARD, repair
from env_server.envs.textarena.games import Game
from env_server.envs.textarena.randomness import PrivateRandom
from env_server.envs.textarena.transcript import Transcript, game_messages
from env_server.envs.textarena.variants import RAW

T = TypeVar("T")
PLAYER = 0  # the only player of a single-player game


def bracketed(reply: str) -> str:
    """TextArena's ActionFormattingWrapper rule: a reply without brackets is wrapped in them."""
    if "[" not in reply and "]" not in reply:
        return f"[{reply}]"
    return reply


class TextArenaOptions(BaseModel):
    """What every game accepts; each game's subclass narrows ``variant`` to that game's variants."""

    model_config = ConfigDict(extra="forbid")

    variant: str


class TextArenaEnv(Env):
    """A TextArena single-player game; subclasses (hosted.py) set ``game`` and the class metadata."""

    family = "textarena"
    runs_inline = False
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py
    game: ClassVar[Game]
    Options: ClassVar[type[TextArenaOptions]]

    def __init__(self) -> None:
        self._random = PrivateRandom()
        self._arena: Any = None  # the TextArena env of the current episode
        self._variant = ""
        self._transcript = Transcript([])

    def reset(self, seed: int, options: TextArenaOptions) -> Observation:
        variant = self._variant = options.variant
        self._random.reseed(seed)
        self._arena, messages = self._call(lambda: _start(variant, seed))
        opening = game_messages(messages)
        self._transcript = Transcript(opening)
        return Observation("\n".join(opening), {"variant": variant, "history": self._transcript.text()})

    def step(self, action: str) -> Step:
        arena = self._arena
        move = bracketed(action)
        done, messages = self._call(lambda: _play(arena, move))
        state = arena.state
        # A warned invalid move leaves error_count at 1 until the next valid one; one that ends
        # the game is recorded in game_info instead.
        valid = not (state.error_count or state.game_info[PLAYER]["invalid_move"])
        answer = game_messages(messages)
        reward = 0.0
        info: dict[str, Any] = {"valid": valid}
        if done:
            rewards, game_info = self._call(arena.close)
            reward = float(rewards[PLAYER])
            reason = str(game_info[PLAYER].get("reason", ""))
            answer.append(reason)
            info.update(success=reward >= WIN_REWARD, reason=reason)
        self._transcript.add_turn(move, answer)
        info["history"] = self._transcript.text()
        return Step("\n".join(answer), reward, done, info)

    def available_actions(self) -> list[str] | None:
        if self.game.actions is None:
            return None
        return self.game.actions(self._arena)

    def _call(self, call: Callable[[], T]) -> T:
        """Run TextArena code with this game's random state, its prints silenced (RushHour prints
        each puzzle it generates, LogicPuzzle a debugging line every move), its crashes a failure."""
        try:
            return self._random.run(lambda: _quietly(call))
        except Exception as exc:
            raise EnvFailure(f"TextArena's {self._variant} raised {type(exc).__name__}: {exc}") from exc


def _start(variant: str, seed: int) -> tuple[Any, list[ta.Message]]:
    arena = ta.make(variant + RAW)
    arena.reset(num_players=1, seed=seed)
    repair(arena.state)
    return arena, arena.get_observation()[1]


def _play(arena: Any, move: str) -> tuple[bool, list[ta.Message]]:
    done, _ = arena.step(move)
    return done, arena.get_observation()[1]


def _quietly(call: Callable[[], T]) -> T:
    # Only under the lock of PrivateRandom.run: sys.stdout is process-wide too.
    with contextlib.redirect_stdout(io.StringIO()):
        return call()
