"""The TextArena single-player games this family hosts: one row each, from which hosted.py makes the classes.

Every single-player game of TextArena 0.7.4 is here except these (the reasons are checked by
tests/unit/test_textarena_envs.py):

================================  ==============================================================
game                              why it is not hosted
================================  ==============================================================
Bandit                            its end reward points the wrong way: it compares the button
                                  with the dict of means, so the best final choice scores 0
                                  ("You chose an incorrect button") and a worse one its regret
Hangman, WordLadder, WordSearch,  need NLTK's ``words`` corpus, which they try to download
Wordle
GuessWho, TwentyQuestions         an LLM plays the other side: they need an OpenRouter API key
Klondike, UltimateTexasHoldem     SyntaxError on import: Klondike's source is broken (an elif
                                  after its if's block ended), UltimateTexasHoldem nests quotes
                                  in an f-string, which only Python 3.12 allows
BabyAiText                        needs the ``gym`` package; embodied/babyai hosts BabyAI
================================  ==============================================================

``max_turns`` is the game's own turn limit, where it has one: TextArena scores a game only when it
ends, so an episode cut shorter would lose its reward. Games without a limit get a bound here.
``reward_range`` bounds TextArena's end-of-game reward: 1 for a win, otherwise a completion
fraction in [0, 1], with three exceptions noted on their rows. ``hint`` adds to TextArena's own
rules what they leave out; ``actions`` lists the moves of games with a small fixed set of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def fixed(*moves: str) -> Callable[[Any], list[str]]:
    """The same moves whatever the variant."""
    return lambda _: list(moves)


DIRECTIONS = fixed("[up]", "[down]", "[left]", "[right]")


@dataclass(frozen=True, slots=True)
class Game:
    """One hosted game: its stargym name, TextArena's default variant, and what an agent is told."""

    name: str
    variant: str  # the default TextArena id; the Options accept every variant of the same game
    title: str
    example: str  # one legal-looking move, for the instruction and action_format
    max_turns: int
    reward_range: tuple[float, float] = (0.0, 1.0)
    hint: str = ""
    actions: Callable[[Any], list[str]] | None = None  # the moves, from the raw TextArena env


GAMES: tuple[Game, ...] = (
    Game("2048", "2048-v0", "2048", "[Up]", 100, actions=fixed("[Up]", "[Down]", "[Left]", "[Right]")),
    Game("blackjack", "Blackjack-v0", "Blackjack", "[Hit]", 30, actions=fixed("[Hit]", "[Stand]")),
    Game("countdown", "Countdown-v0", "Countdown", "[0 2 *]", 12),
    Game("crosswords", "Crosswords-v0", "Crosswords", "[8 2 u]", 30),
    Game(
        "cryptarithm",
        "Cryptarithm-v0",
        "Cryptarithm",
        "[S 9]",
        100,
        hint="The game ends when every letter has a digit, and is won if the equation then holds.",
    ),
    Game("fifteen_puzzle", "FifteenPuzzle-v0", "the 15-Puzzle", "[up]", 200, actions=DIRECTIONS),
    Game("frozen_lake", "FrozenLake-v0", "Frozen Lake", "[right]", 100, actions=DIRECTIONS),
    Game(
        "guess_the_number",
        "GuessTheNumber-v0",
        "Guess The Number",
        "[10]",
        10,
        actions=lambda arena: [f"[{n}]" for n in range(arena.min_number, arena.max_number + 1)],
    ),
    Game(
        "lights_out",
        "LightsOut-v0",
        "Lights Out",
        "[2 3]",
        20,
        # Its completion fraction is (lights on at the start − lights on now) / lights on at the
        # start, unbounded below: at worst one light on at the start and all 25 at the end.
        reward_range=(-24.0, 1.0),
        actions=lambda arena: [f"[{row} {col}]" for row in range(arena.size) for col in range(arena.size)],
    ),
    Game("logic_puzzle", "LogicPuzzle-v0", "Logic Puzzle", "[gasoline bob O]", 30),
    Game("mastermind", "Mastermind-v0", "Mastermind", "[1 2 3 4]", 20),
    Game("minesweeper", "Minesweeper-v0", "Minesweeper", "[3 2]", 100),
    Game(
        "peg_jump",
        "PegJump-v0",
        "Peg Jump",
        "[12 5]",
        13,  # 14 pegs, one fewer per jump: at most 13 jumps
        hint="A move '[4 1]' jumps the peg in hole 4 over hole 2 into the empty hole 1.",
    ),
    Game(
        "rush_hour",
        "RushHour-v0",
        "Rush Hour",
        "[A+]",
        50,
        hint="'+' moves a car one cell right (a horizontal car) or down (a vertical one), '-' left or up.",
    ),
    Game(
        "secretary",
        "Secretary-v0",
        "the Secretary problem",
        "[continue]",
        5,
        reward_range=(-1.0, 1.0),  # a second invalid move in a row scores TextArena's default -1
        actions=fixed("[accept]", "[continue]"),
    ),
    Game(
        "set",
        "Set-v0",
        "Set",
        "[1, 4, 11]",
        20,
        # Not won or lost: the reward is the number of Sets found, so success means one or more.
        reward_range=(0.0, 20.0),
        hint="The score is the number of Sets you find.",
    ),
    Game("slitherlink", "Slitherlink-v0", "Slitherlink", "[h 0 1]", 200),
    Game(
        "sokoban",
        "Sokoban-v0",
        "Sokoban",
        "[up]",
        30,
        hint="Moves are [up], [down], [left] and [right].",
        actions=DIRECTIONS,
    ),
    Game("sudoku", "Sudoku-v0", "Sudoku", "[5 3 7]", 100),
    Game(
        "three_card_monte",
        "ThreeCardMonte-v0",
        "Three-Card Monte",
        "[1]",
        1,
        actions=lambda arena: [f"[{cup}]" for cup in range(arena.num_cups)],
    ),
    Game(
        "tower_of_hanoi",
        "TowerOfHanoi-v0",
        "the Tower of Hanoi",
        "[A C]",
        14,
        actions=fixed("[A B]", "[A C]", "[B A]", "[B C]", "[C A]", "[C B]"),
    ),
)
