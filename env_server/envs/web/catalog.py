"""The shop's products and shopping goals: generated from a seed, or read from WebShop's own files.

**Generated** (:func:`generate_catalog`): :data:`PRODUCTS_PER_TYPE` products for each of the 40
product types of :mod:`.catalog_tables` (10,400 in all), each with a title, a category path,
3-5 attributes, options (sizes, colours, flavours; 2-4 values of each the type has), a price,
a rating, a description, features and reviews. Everything comes from ``random.Random`` seeded
by a string (SHA-512 seeding: the same in every process), so a seed gives the same catalog
byte for byte on every machine. Building it takes ~0.3 s (2-core dev machine).

**Goals** (:func:`make_goal`): one per product, in WebShop's synthetic style: the product's
type, 1-3 of its attributes, one value of each of its options and a price bound a few steps of
$10 above its price ("i am looking for a sulfate free shampoo with scent: lavender, and size:
16 fl oz, and price lower than 20.00 dollars"). Goals are split train/dev/test 80/10/10 by the
SHA-256 of their product's ASIN, so a test goal never asks for a product a train goal asks for.

**WebShop's files** (:func:`load_webshop`): ``items_shuffle.json`` (the scraped products) and
``items_ins_v2.json`` (their attributes and crowd-written instructions, by ASIN), as WebShop's
setup downloads them. Their instructions become the goals, with the options and the price bound
added as WebShop's synthetic goals add them; the splits are by ASIN as above.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from env_server.envs.search.corpus import Passage
from env_server.envs.search.facts import DEFAULT_SPLITS, split_of
from env_server.envs.search.facts_questions import stable_hash
from env_server.envs.web.catalog_tables import BRANDS, PRODUCT_TYPES, REVIEW_LINES, TITLE_STYLES, ProductType

PRODUCTS_PER_TYPE = 260
DEFAULT_SEED = 0
CATEGORY_SEPARATOR = " › "  # WebShop's product_category separator
# WebShop's price bounds: multiples of $10; a goal's bound is one of the first four above the price.
PRICE_STEP = 10.0
NO_PRICE_BOUND = 1_000_000.0  # WebShop's stand-in for "no bound" (a product without a price)
PRICE = re.compile(r"\$?\s*(\d+(?:,\d{3})*(?:\.\d+)?)")


class Product(BaseModel):
    """One product as the shop shows it and the reward reads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    asin: str = Field(min_length=1)
    title: str
    query: str = Field(
        description="The search the product belongs to (WebShop: the query it was scraped by)."
    )
    category: str
    product_category: str = Field(description="Category path, top first, joined by ' › '.")
    type_nouns: tuple[str, ...] = Field(description="Nouns of the product's type (the type reward's).")
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]] = Field(description="Option name -> the values a buyer picks from.")
    price: float = Field(ge=0)
    rating: float | None = None
    description: str = ""
    features: tuple[str, ...] = ()
    reviews: tuple[tuple[int, str], ...] = Field(default=(), description="(stars 1-5, text) pairs.")


class Goal(BaseModel):
    """What the shopper wants: WebShop's goal record."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    asin: str
    instruction: str
    query: str
    product_category: str
    type_nouns: tuple[str, ...]
    attributes: tuple[str, ...] = Field(min_length=1)
    options: dict[str, str]
    price_upper: float


@dataclass(frozen=True)
class Catalog:
    """The products by ASIN (in catalog order) and the goals of each split."""

    products: dict[str, Product]
    goals: dict[str, list[Goal]]

    def __post_init__(self) -> None:
        empty = [name for name in DEFAULT_SPLITS if not self.goals.get(name)]
        if empty:
            raise ValueError(f"the catalog has no goals in split(s) {', '.join(empty)}")


class CatalogFileError(ValueError):
    """A WebShop product or attribute file that cannot be used; the message names the file and why."""


# --- the generated catalog --------------------------------------------------------------------


def generate_catalog(seed: int = DEFAULT_SEED, per_type: int = PRODUCTS_PER_TYPE) -> Catalog:
    """The default catalog: ``per_type`` products of each type and one goal per product."""
    products: dict[str, Product] = {}
    for kind in PRODUCT_TYPES:
        for number in range(per_type):
            product = make_product(kind, random.Random(f"stargym-shop/{seed}/{kind.query}/{number}"))
            if product.asin in products:  # 40 bits of ASIN: a clash would be a bug, not bad luck
                raise RuntimeError(f"ASIN {product.asin} generated twice")
            products[product.asin] = product
    goals = [
        make_goal(product, random.Random(f"stargym-goal/{seed}/{asin}")) for asin, product in products.items()
    ]
    return Catalog(products, split_goals(goals))


def make_product(kind: ProductType, rng: random.Random) -> Product:
    brand = rng.choice(BRANDS[kind.category])
    attributes = tuple(rng.sample(kind.attributes, rng.randint(3, min(5, len(kind.attributes)))))
    options = {
        name: tuple(sorted(rng.sample(values, rng.randint(2, min(4, len(values)))), key=values.index))
        for name, values in kind.options.items()
    }
    low, high = kind.price
    price = round(rng.uniform(low, high)) - 0.01 if high - low >= 1 else low
    type_name = kind.query.title()
    style = rng.choice(TITLE_STYLES)
    title = f"{brand} {style} {type_name}, {attributes[0].title()} and {attributes[1].title()}"
    if len(attributes) > 2:
        title += f", {attributes[2].capitalize()}"
    features = tuple(
        f"{attribute.upper() if len(attribute) <= 4 else attribute.capitalize()}: "
        f"{rng.choice(_FEATURE_PHRASES).format(type=kind.query)}"
        for attribute in attributes
    )
    description = (
        f"{brand} makes this {kind.query} {attributes[0]} and {attributes[1]}. "
        f"{rng.choice(_DESCRIPTION_LINES).format(type=kind.query, brand=brand)} "
        f"Available in {', '.join(f'{len(values)} {name}s' for name, values in options.items())}."
    )
    reviews = tuple((rng.randint(3, 5), rng.choice(REVIEW_LINES)) for _ in range(rng.randint(1, 3)))
    rating = round(sum(stars for stars, _ in reviews) / len(reviews), 1)
    return Product(
        asin="B0" + "".join(rng.choice(_ASIN_CHARS) for _ in range(8)),
        title=title,
        query=kind.query,
        category=kind.category,
        product_category=CATEGORY_SEPARATOR.join(kind.path),
        type_nouns=kind.nouns,
        attributes=attributes,
        options=options,
        price=price,
        rating=rating,
        description=description,
        features=features,
        reviews=reviews,
    )


_ASIN_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_FEATURE_PHRASES = (
    "made to last, tested by our team",
    "what customers ask for most in a {type}",
    "checked on every batch before it ships",
    "the reason this {type} is a best seller",
    "as rated by thousands of buyers",
)
_DESCRIPTION_LINES = (
    "Every {type} from {brand} is backed by a 30-day return policy.",
    "Designed for everyday use and easy care.",
    "A favourite of repeat customers for years.",
    "Packed with care and shipped within two days.",
)
_OPENINGS = ("i need", "i am looking for", "i want", "find me", "i would like")


def price_bound(price: float, rng: random.Random) -> float:
    """One of the first four multiples of $10 above ``price`` (WebShop's synthetic goals)."""
    first = (int(price // PRICE_STEP) + 1) * PRICE_STEP
    return first + PRICE_STEP * rng.randrange(4)


def make_goal(product: Product, rng: random.Random, instruction: str | None = None) -> Goal:
    """A goal for ``product``; ``instruction``: a written one (WebShop's files) instead of ours."""
    attributes = tuple(rng.sample(product.attributes, min(len(product.attributes), rng.randint(1, 3))))
    options = {name: rng.choice(values) for name, values in product.options.items() if values}
    bound = price_bound(product.price, rng) if product.price > 0 else NO_PRICE_BOUND
    if instruction is None:
        if len(attributes) == 1:
            wants = f"{attributes[0]} {product.query}"
        else:
            wants = f"{product.query} that is {', '.join(attributes[:-1])} and {attributes[-1]}"
        instruction = f"{rng.choice(_OPENINGS)} {wants}"
    text = instruction.strip().rstrip(".")
    if options:
        text += " with " + ", and ".join(f"{name}: {value}" for name, value in options.items())
    if bound != NO_PRICE_BOUND:
        text += f", and price lower than {bound:.2f} dollars"
    return Goal(
        asin=product.asin,
        instruction=text,
        query=product.query,
        product_category=product.product_category,
        type_nouns=product.type_nouns,
        attributes=attributes,
        options=options,
        price_upper=bound,
    )


def split_goals(goals: Iterable[Goal]) -> dict[str, list[Goal]]:
    """Goals by the split of their product's ASIN (:func:`env_server.envs.search.facts.split_of`),
    each split in an order shuffled by a hash of the ASIN: the catalog lists its products type by
    type, and a run of consecutive seeds (a held-out range) must not be one or two product types."""
    splits: dict[str, list[Goal]] = {name: [] for name in DEFAULT_SPLITS}
    for goal in goals:
        splits[split_of(f"shop/{goal.asin}")].append(goal)
    for split in splits.values():
        split.sort(key=lambda goal: stable_hash(f"shop-order/{goal.asin}"))
    return splits


# --- WebShop's files ----------------------------------------------------------------------------


def load_webshop(items_path: Path, attributes_path: Path, seed: int = DEFAULT_SEED) -> Catalog:
    """WebShop's ``items_shuffle.json`` and ``items_ins_v2.json`` as a catalog (see the module doc).

    Products without a title or an ASIN are skipped, as WebShop's loader skips them; goals are
    made for the products whose attribute record has an instruction and at least one attribute.
    """
    items = _read_json(items_path, list)
    extra = _read_json(attributes_path, dict)
    products: dict[str, Product] = {}
    instructions: dict[str, tuple[str, tuple[str, ...]]] = {}
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise CatalogFileError(f"{items_path}: item {position} is not an object")
        asin, title = item.get("asin"), item.get("name") or item.get("Title")
        if not asin or not title or asin in products:
            continue
        record = extra.get(asin) or {}
        products[asin] = _webshop_product(item, record)
        attributes = tuple(record.get("instruction_attributes") or ())
        if record.get("instruction") and attributes:
            instructions[asin] = (str(record["instruction"]), tuple(str(a) for a in attributes))
    if not products:
        raise CatalogFileError(f"{items_path}: no product with an asin and a name")
    goals = []
    for asin, (instruction, attributes) in instructions.items():
        goal = make_goal(products[asin], random.Random(f"stargym-goal/{seed}/{asin}"), instruction)
        goals.append(goal.model_copy(update={"attributes": attributes}))
    try:
        return Catalog(products, split_goals(goals))
    except ValueError as exc:
        raise CatalogFileError(f"{attributes_path}: {exc} (too few products with instructions)") from None


def _read_json(path: Path, kind: type) -> Any:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CatalogFileError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogFileError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, kind):
        raise CatalogFileError(f"{path}: expected a JSON {'list' if kind is list else 'object'}")
    return data


def _webshop_product(item: dict[str, Any], record: dict[str, Any]) -> Product:
    options: dict[str, tuple[str, ...]] = {}
    for name, values in (item.get("customization_options") or {}).items():
        picked = tuple(
            str(value.get("value") if isinstance(value, dict) else value).strip().lower()
            for value in values or ()
        )
        if picked:
            options[str(name).strip().lower()] = picked
    category = str(item.get("product_category") or item.get("category") or "")
    features = item.get("small_description") or []
    if isinstance(features, str):
        features = [features]
    rating = item.get("average_rating")
    return Product(
        asin=str(item["asin"]),
        title=str(item.get("name") or item.get("Title")),
        query=str(item.get("query") or ""),
        category=str(item.get("category") or ""),
        product_category=category,
        type_nouns=title_nouns(str(item.get("name") or item.get("Title"))),
        attributes=tuple(str(a) for a in record.get("attributes") or ()),
        options=options,
        price=parse_price(item.get("pricing")),
        rating=float(rating) if isinstance(rating, int | float) else None,
        description=str(item.get("full_description") or ""),
        features=tuple(str(f) for f in features),
    )


def parse_price(pricing: Any) -> float:
    """WebShop's ``pricing``: ``"$12.99"``, ``"$10.99 - $20.99"`` (the lower end is the price), a
    number or a list of them; 0 when there is none."""
    if isinstance(pricing, int | float):
        return float(pricing)
    if isinstance(pricing, list):
        pricing = " ".join(str(p) for p in pricing)
    found = PRICE.findall(str(pricing or ""))
    return min(float(p.replace(",", "")) for p in found) if found else 0.0


_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "the",
        "of",
        "for",
        "with",
        "to",
        "in",
        "on",
        "by",
        "from",
        "at",
        "or",
        "&",
        "-",
        "x",
        "pack",
        "count",
        "oz",
        "ounce",
        "inch",
        "set",
        "new",
    ]
)


def title_nouns(title: str) -> tuple[str, ...]:
    """The content words of a real product's title, for the type reward.

    WebShop tags nouns with spaCy's ``en_core_web_lg``, a model that cannot be downloaded here;
    a real title's words minus stopwords and numbers stand in for them (the generated catalog
    knows its types' nouns and does not need this).
    """
    words = re.findall(r"[a-z][a-z']+", title.lower())
    return tuple(dict.fromkeys(word for word in words if word not in _STOPWORDS))


def product_passages(products: Iterable[Product]) -> list[Passage]:
    """Each product as a passage of the search index: its title, and as text its query, category,
    attributes, features and description."""
    return [
        Passage(
            id=p.asin,
            title=p.title,
            text=" ".join([p.query, p.product_category, *p.attributes, *p.features, p.description]),
        )
        for p in products
    ]
