"""WebShop's reward for a purchase: how well the bought product and options match the goal.

With ``A`` the goal's attributes, ``O`` its options and the price bound::

    reward = r_type * (matched attributes + matched options + [price <= bound]) / (|A| + |O| + 1)

- an attribute matches when one of the product's attributes is a fuzzy match (rapidfuzz's
  ``token_set_ratio`` above 85, the threshold WebShop uses with thefuzz), or the attribute is
  written in the product's title, features or description;
- an option matches when one of the chosen option values is a fuzzy match above 85;
- ``r_type`` is 1 when the product is of the goal's type, less when it only may be: the share
  of the goal type's nouns that the bought product's nouns (its type's, or its title's words)
  contain gives the title score; 0 for none, 0.1 below 0.1, otherwise 1 when the query matches,
  two category levels are shared or the title score exceeds 0.2, and 0.5 when none of those does.

**Departure.** WebShop finds nouns with spaCy's ``en_core_web_lg`` tagger, a model that cannot be
downloaded here. The generated catalog knows each type's nouns; a real WebShop product's come
from :func:`.catalog.title_nouns` (its title's content words), so the type score of WebShop's
own products is close to, not exactly, theirs. Colour names are compared as written (WebShop
first maps some colour spellings onto one name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from rapidfuzz import fuzz

from env_server.envs.web.catalog import CATEGORY_SEPARATOR, Goal, Product

FUZZY_MATCH = 85.0  # WebShop's threshold: token_set_ratio strictly above it is a match


@dataclass(frozen=True)
class Score:
    """A purchase's reward and its parts (what ``info`` reports after a purchase)."""

    reward: float
    r_type: float
    attributes_matched: int
    options_matched: int
    price_ok: bool
    title_score: float

    def as_info(self) -> dict[str, float | int | bool]:
        return asdict(self)


def type_reward(product: Product, goal: Goal) -> tuple[float, float]:
    """``(r_type, title_score)`` of buying ``product`` for ``goal`` (see the module docstring)."""
    wanted = set(goal.type_nouns)
    have = set(product.type_nouns) | set(product.title.lower().replace(",", " ").split())
    title_score = len(wanted & have) / len(wanted) if wanted else 0.2
    if title_score == 0.0:
        return 0.0, title_score
    if title_score < 0.1:
        return 0.1, title_score
    shared_levels = set(_levels(product.product_category)) & set(_levels(goal.product_category))
    matches = product.query == goal.query or len(shared_levels) >= 2 or title_score > 0.2
    return (1.0 if matches else 0.5), title_score


def attributes_matched(product: Product, goal: Goal) -> int:
    text = " ".join([product.title, *product.features, product.description]).lower()
    return sum(
        any(fuzz.token_set_ratio(have, wanted) > FUZZY_MATCH for have in product.attributes) or wanted in text
        for wanted in goal.attributes
    )


def options_matched(chosen: Mapping[str, str], goal: Goal) -> int:
    values = list(chosen.values())
    return sum(
        any(fuzz.token_set_ratio(value, wanted) > FUZZY_MATCH for value in values)
        for wanted in goal.options.values()
    )


def purchase_score(product: Product, chosen: Mapping[str, str], price: float, goal: Goal) -> Score:
    """The reward of buying ``product`` with options ``chosen`` (name -> value) at ``price``."""
    r_type, title_score = type_reward(product, goal)
    attributes = attributes_matched(product, goal)
    options = options_matched(chosen, goal)
    price_ok = price <= goal.price_upper
    total = (attributes + options + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
    return Score(r_type * total, r_type, attributes, options, price_ok, title_score)


def _levels(path: str) -> list[str]:
    return [level.strip() for level in path.split(CATEGORY_SEPARATOR.strip()) if level.strip()]
