"""A TextCraft solver that sees only what an agent sees: the crafting commands and the goal.

It reads the recipes off the observation, works out which base ingredients to get and which
recipes to apply (depth first, keeping track of what the inventory holds so leftovers are used
and an ingredient consumed by a sibling's recipe is fetched again), and returns the actions.
Reaching the goal with them proves a task is solvable from its text alone.

A generic ingredient (``planks``, ``wool``) has no recipe of its own: some recipes' outputs are
specific kinds of it (``oak planks``: named after it, and not made from it), and the planner uses
the first kind it can make. Every other ingredient without a recipe is a base item to get.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

TASK = re.compile(r"Crafting commands:\n(?P<commands>.*)\n\nGoal: craft (?P<goal>.+)\.", re.DOTALL)
COMMAND = re.compile(r"craft (?P<count>\d+) (?P<output>.+?) using (?P<ingredients>.+)")
INGREDIENT = re.compile(r"(?P<count>\d+) (?P<name>.+)")
MAX_ROUNDS = 100  # per recipe; a plan that needs more is looping, not progressing


class PlanError(ValueError):
    """The observation holds no task, or its recipes cannot make the goal."""


@dataclass(frozen=True)
class Recipe:
    output: str
    count: int
    ingredients: tuple[tuple[str, int], ...]


def parse_task(observation: str) -> tuple[str, list[Recipe]]:
    """The goal and the recipes of a TextCraft observation."""
    task = TASK.search(observation)
    if task is None:
        raise PlanError(f"no TextCraft task in {observation!r}")
    recipes = []
    for line in task["commands"].splitlines():
        command = COMMAND.fullmatch(line.strip())
        if command is None:
            raise PlanError(f"not a crafting command: {line!r}")
        ingredients = tuple(
            (part["name"], int(part["count"]))
            for part in (INGREDIENT.fullmatch(text.strip()) for text in command["ingredients"].split(","))
            if part is not None
        )
        recipes.append(Recipe(command["output"], int(command["count"]), ingredients))
    return task["goal"], recipes


def plan(observation: str) -> list[str]:
    """The actions that craft the goal of ``observation``, the last one crafting the goal itself."""
    goal, recipes = parse_task(observation)
    planner = _Planner(recipes)
    planner.acquire(goal, 1, frozenset())
    return planner.actions


class _Planner:
    def __init__(self, recipes: list[Recipe]) -> None:
        self.recipes: dict[str, list[Recipe]] = {}
        for recipe in sorted(recipes, key=lambda r: (r.output, r.ingredients)):
            self.recipes.setdefault(recipe.output, []).append(recipe)
        self.inventory: Counter[str] = Counter()
        self.actions: list[str] = []

    def acquire(self, name: str, count: int, making: frozenset[str]) -> None:
        """Make the inventory hold ``count`` of ``name``; ``making`` is what is being made above."""
        item = self.resolve(name, making)
        recipe = self.recipe_for(item, making)
        if recipe is None:
            missing = count - self.inventory[item]
            if missing > 0:
                self.actions.append(f"get {missing} {item}")
                self.inventory[item] += missing
            return
        for _ in range(MAX_ROUNDS):
            if self.inventory[item] >= count:
                return
            rounds = math.ceil((count - self.inventory[item]) / recipe.count)
            for ingredient, needed in recipe.ingredients:
                self.acquire(ingredient, needed * rounds, making | {item})
            while self.inventory[item] < count and self.can_craft(recipe, making):
                self.craft(recipe, making)
        raise PlanError(f"cannot gather the ingredients of {item}")

    def resolve(self, name: str, making: frozenset[str]) -> str:
        """``name`` itself, or for a generic ingredient the first specific kind that can be made."""
        if name in self.recipes:
            return name
        kinds = sorted(output for output in self.recipes if self.is_kind_of(output, name))
        usable = [kind for kind in kinds if kind not in making and self.recipe_for(kind, making)]
        return usable[0] if usable else name

    def is_kind_of(self, output: str, name: str) -> bool:
        """``oak planks`` is a kind of ``planks``; ``polished blackstone``, made from blackstone, is not."""
        made_from = {ingredient for recipe in self.recipes[output] for ingredient, _ in recipe.ingredients}
        return output.endswith(f" {name}") and name not in made_from

    def recipe_for(self, item: str, making: frozenset[str]) -> Recipe | None:
        """The first recipe of ``item`` that does not need something already being made."""
        for recipe in self.recipes.get(item, []):
            inner = making | {item}
            if all(self.resolve(name, inner) not in inner for name, _ in recipe.ingredients):
                return recipe
        return None

    def can_craft(self, recipe: Recipe, making: frozenset[str]) -> bool:
        inner = making | {recipe.output}
        return all(self.inventory[self.resolve(name, inner)] >= count for name, count in recipe.ingredients)

    def craft(self, recipe: Recipe, making: frozenset[str]) -> None:
        inner = making | {recipe.output}
        parts = [(self.resolve(name, inner), count) for name, count in recipe.ingredients]
        self.actions.append(
            f"craft {recipe.count} {recipe.output} using "
            + ", ".join(f"{count} {item}" for item, count in parts)
        )
        for item, count in parts:
            self.inventory[item] -= count
        self.inventory[recipe.output] += recipe.count
