"""What the agent reads: the game's new messages after each move, and the whole exchange so far.

TextArena's default ids answer every move with the entire history as one string, which grows each
turn and repeats the rules; an agent here gets only what the game said since its last move (at
reset, the rules and the opening board), and ``info["history"]`` holds the whole exchange in the
``[GAME] …`` / ``[Player] …`` lines of TextArena's LLMObservationWrapper. The messages come from
the raw ids' observation lists, which TextArena empties each time they are read.
"""

from __future__ import annotations

from collections.abc import Iterable

from textarena import GAME_ID, Message, ObservationType


def game_messages(messages: Iterable[Message]) -> list[str]:
    """The game's own messages, without the echo of the player's move.

    TextArena sends each move back as a PLAYER_ACTION message, from the player (from the game in
    TowerOfHanoi). Countdown, Cryptarithm and Slitherlink pass ``add_observation``'s arguments out
    of order, so their echo has an ObservationType as its sender: it is dropped by the sender test.
    """
    return [
        str(text)
        for sender, text, kind in messages
        if sender == GAME_ID and kind != ObservationType.PLAYER_ACTION
    ]


class Transcript:
    """The exchange of one episode, rendered as TextArena's LLMObservationWrapper renders it."""

    def __init__(self, opening: list[str]) -> None:
        self._lines = [f"[GAME] {text}" for text in opening]

    def add_turn(self, move: str, answer: list[str]) -> None:
        self._lines.append(f"[Player] {move}")
        self._lines.extend(f"[GAME] {text}" for text in answer)

    def text(self) -> str:
        return "\n".join(self._lines)
