"""Repairs of two TextArena 0.7.4 bugs on a game's state, applied after every reset.

- Countdown, Cryptarithm, Slitherlink and ThreeCardMonte call ``set_invalid_move(progress, reason)``
  while the signature is ``set_invalid_move(reason, reward)``: the warning they give reads
  "Reason: 0.568" and a game they end on an invalid move scores a string. The repaired call puts
  the two back in order when the reason is the number and the reward the text.
- FifteenPuzzle ends a solved puzzle with ``set_winners``, a method of two-player states only, so
  solving it raised AttributeError. A single-player state gets it as a win (reward 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textarena import SinglePlayerState

WIN_REWARD = 1.0  # what every TextArena single-player game scores a win


def repair(state: SinglePlayerState) -> None:
    """Patch ``state`` in place; both repairs leave correct calls as they are."""
    state.set_invalid_move = _in_order(state.set_invalid_move)
    if not hasattr(state, "set_winners"):
        state.set_winners = lambda player_ids, reason: state.set_outcome(reward=WIN_REWARD, reason=reason)


def _in_order(set_invalid_move: Callable[..., None]) -> Callable[..., None]:
    def ordered(reason: Any = None, reward: Any = -1.0) -> None:
        if isinstance(reward, str) and not isinstance(reason, str):
            reason, reward = reward, reason
        set_invalid_move(reason=reason, reward=reward)

    return ordered
