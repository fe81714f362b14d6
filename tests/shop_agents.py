"""Agents for web/shop that play through a step function: an oracle that knows the target, a random one.

Both see only what an agent sees (the observation and the available actions), except that the
oracle is told the goal's product; shared by the unit, integration and browser tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from env_server.envs.web.catalog import Goal, Product

MAX_TURNS = 15  # web/shop's default_max_turns
PAGES_SEARCHED = 5  # WebShop's 50 results at 10 a page


@dataclass
class Outcome:
    reward: float = 0.0
    done: bool = False
    success: bool = False
    actions: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)


# step(action) -> (observation, reward, done, info); actions() -> the available actions or None
Stepper = Callable[[str], tuple[str, float, bool, dict]]
Actions = Callable[[], list[str] | None]


def _take(outcome: Outcome, step: Stepper, action: str) -> tuple[str, dict]:
    observation, reward, done, info = step(action)
    outcome.actions.append(action)
    outcome.urls.append(info.get("url", ""))
    outcome.reward, outcome.done = reward, done
    outcome.success = bool(info.get("success", False))
    return observation, info


def oracle(product: Product, goal: Goal, step: Stepper, actions: Actions) -> Outcome:
    """Search the target's title, open it (paging if needed), pick the goal's options, buy."""
    outcome = Outcome()
    _take(outcome, step, f"search[{product.title}]")
    wanted = f"click[{product.asin.lower()}]"
    for _ in range(PAGES_SEARCHED):
        available = actions() or []
        if wanted in available or "click[next >]" not in available:
            break
        _take(outcome, step, "click[next >]")
    _take(outcome, step, wanted)
    for value in goal.options.values():
        _take(outcome, step, f"click[{value}]")
    _take(outcome, step, "click[buy now]")
    return outcome


def random_agent(instruction: str, step: Stepper, actions: Actions, rng: random.Random) -> Outcome:
    """Search three words of the instruction where there is a search bar, else click at random."""
    outcome = Outcome()
    words = instruction.split()
    for _ in range(MAX_TURNS):
        available = actions()
        action = f"search[{' '.join(rng.sample(words, 3))}]" if available is None else rng.choice(available)
        _take(outcome, step, action)
        if outcome.done:
            break
    return outcome
