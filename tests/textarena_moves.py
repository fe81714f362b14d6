"""One legal first move of every hosted textarena game at seed SEED, and a reply no game accepts.

Legal means TextArena judges it valid (``info["valid"]``); it may end the game (ThreeCardMonte's
only guess). The seed-dependent ones (2048, Crosswords, the 15-Puzzle, FrozenLake, LogicPuzzle,
RushHour, Sokoban, Sudoku) were read off the seed's game. Shared by the unit and HTTP tests.
"""

from __future__ import annotations

SEED = 0
GARBAGE = "garbage"  # TextArena makes it "[garbage]", which no game's move syntax matches

FIRST_MOVES = {
    "2048": "[Up]",
    "blackjack": "[Stand]",
    "countdown": "[0 1 +]",
    "crosswords": "[3 2 r]",
    "cryptarithm": "[S 9]",
    "fifteen_puzzle": "[down]",
    "frozen_lake": "[down]",
    "guess_the_number": "[10]",
    "lights_out": "[0 0]",
    "logic_puzzle": "[pizza alice O]",
    "mastermind": "[1 2 3 4]",
    "minesweeper": "[0 0]",
    "peg_jump": "[12 5]",
    "rush_hour": "[A+]",
    "secretary": "[continue]",
    "set": "[1, 2, 3]",
    "slitherlink": "[h 0 0]",
    "sokoban": "[up]",
    "sudoku": "[1 4 7]",
    "three_card_monte": "[1]",
    "tower_of_hanoi": "[A C]",
}
