"""A random stream of its own for each game, although TextArena draws from Python's process-wide one.

TextArena's ``State`` calls ``random.seed(seed)`` at reset and its games call ``random.randint``
and friends during play (2048 spawns tiles, Minesweeper lays its mines on the first move), so two
games stepping in one process would draw from, and reseed, each other's stream. Each game keeps
its own ``random`` state instead, swapped into the global one around every call into TextArena
under one process-wide lock, and the global state is put back afterwards. numpy's global generator
needs no such care: no hosted game draws from it (Sokoban seeds its own ``default_rng(seed)``), and
a test checks that playing every game leaves it untouched.

The lock makes calls into TextArena one at a time per process. Most take microseconds, and the
swap adds about 30 µs (two getstate/setstate pairs of the 625-word Mersenne Twister state); the
slow ones are RushHour's and Sokoban's resets (a quarter to one second: env.py), during which every
other TextArena call of the process waits. Code that draws from the global ``random`` without the
lock would still draw from whichever game's state is swapped in: the env host draws none (its seeds
come from ``secrets``, its instance ids from ``uuid4``).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Python's global ``random`` is process-wide, so the lock that guards its swaps is too.
_GLOBAL_RANDOM = threading.Lock()


class PrivateRandom:
    """One game's random state, lent to the process-wide ``random`` while its calls run."""

    def __init__(self) -> None:
        self._state = random.Random(0).getstate()

    def reseed(self, seed: int) -> None:
        """Start from ``seed``: what TextArena's reset does, but also for draws made before it seeds."""
        self._state = random.Random(seed).getstate()

    def run(self, call: Callable[[], T]) -> T:
        """Run ``call`` with this game's state as the global ``random``; keep what it drew."""
        with _GLOBAL_RANDOM:
            outer = random.getstate()
            random.setstate(self._state)
            try:
                return call()
            finally:
                self._state = random.getstate()
                random.setstate(outer)
