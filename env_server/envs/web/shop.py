"""WebShop: buy the product an instruction describes, in a shop that is a real web site.

The agent starts on the shop's search page with an instruction ("i need a long lasting lipstick
with color: berry, and price lower than 20.00 dollars"), and acts as in WebShop:
``search[keywords]`` where the page has a search bar, ``click[value]`` for any link or button
the page shows (a product's ASIN, an option value, ``Next >``, ``< Prev``, ``Back to Search``,
``Description``/``Features``/``Reviews``, ``Buy Now``; matched without regard to case). Its
observation is the text of the page's HTML in WebShop's ``[SEP]`` style (:mod:`.site`), and
the same pages are served at ``/shop/<instance id>/`` for a person to watch (:mod:`.routes`).
Buying ends the episode with WebShop's reward (:mod:`.reward`); success is a reward of 1.

An action the page does not offer (a click on something not shown, a search without a search
bar or without words, a reply in neither form) is an observation saying what is wrong, followed
by the page again, with ``info["valid"]`` False; the page stays as it was.

**Data.** The generated catalog of :mod:`.catalog` (seed ``STARGYM_WEB_CATALOG_SEED``), or
WebShop's own product files when ``STARGYM_WEB_CATALOG`` and ``STARGYM_WEB_ATTRIBUTES`` are both
set (:class:`WebSettings`). Loaded once per process, with the search index, by
:meth:`ShopEnv.prepare` (~1.5 s warm), and shared by every instance.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from env_server.core import Env, Observation, Step
from env_server.envs.search.facts import cache_root
from env_server.envs.search.retriever import Retriever, query_terms, shared_retriever
from env_server.envs.web import catalog as catalogs
from env_server.envs.web.catalog import Catalog, CatalogFileError, Goal, Product
from env_server.envs.web.site import (
    MAX_RESULTS,
    START,
    Page,
    PageText,
    ShopView,
    follow,
    read_page,
    render,
    score_purchase,
)
from env_server.shared import ProcessShared
from services.errors import ApiError

AGENTGYM_ORDER = ("test", "train", "dev")  # AgentGym's session ids: its test goals come first
ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.DOTALL | re.IGNORECASE)
MAX_QUERY_CHARS = 500  # a longer search keeps its first 500 characters (the URL carries it)
SUCCESS = 1.0 - 1e-9
SEARCH_CACHE = 4096  # queries whose results are kept: a results page re-renders its search

# AgentGym's WebShop prompt (its conversation start), without the reply format of its ReAct
# template: the rollout worker's action format adds that.
INSTRUCTION = (
    "You are web shopping.\nI will give you instructions about what to do.\nYou have to follow the "
    "instructions.\nEvery round I will give you an observation and a list of available actions, you "
    "have to respond an action based on the state and instruction.\nYou can use search action if "
    "search is available.\nYou can click one of the buttons in clickables.\nAn action should be of "
    "the following structure:\nsearch[keywords]\nclick[value]\nIf the action is not valid, perform "
    "nothing.\nKeywords in search are up to you, but the value in click must be a value in the list "
    "of available actions.\nRemember that your keywords in search should be carefully designed."
)


class WebSettings(BaseSettings):
    """Which catalog the shop serves: WebShop's files (both), or the generated one (neither)."""

    model_config = SettingsConfigDict(env_prefix="STARGYM_WEB_", extra="ignore", env_ignore_empty=True)

    catalog: FilePath | None = Field(default=None, description="WebShop's items_shuffle.json.")
    attributes: FilePath | None = Field(default=None, description="WebShop's items_ins_v2.json.")
    catalog_seed: int = Field(
        default=catalogs.DEFAULT_SEED, ge=0, description="Seed of the generated catalog."
    )

    @model_validator(mode="after")
    def both_or_neither(self) -> WebSettings:
        if (self.catalog is None) != (self.attributes is None):
            given, missing = (
                ("catalog", "attributes") if self.attributes is None else ("attributes", "catalog")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: give WebShop's items_shuffle.json and "
                "items_ins_v2.json (STARGYM_WEB_CATALOG, STARGYM_WEB_ATTRIBUTES), or neither for the "
                "generated catalog"
            )
        return self


class ShopData:
    """What every instance of a process shares: the catalog and its search index."""

    def __init__(self, catalog: Catalog, retriever: Retriever) -> None:
        self.catalog = catalog
        self.retriever = retriever
        # Cached per process: a results page renders its search again at every click on it.
        self.search: Callable[[str], list[Product]] = functools.lru_cache(maxsize=SEARCH_CACHE)(self._search)

    def _search(self, query: str) -> list[Product]:
        products = self.catalog.products
        return [products[passage.id] for passage in self.retriever.search(query, MAX_RESULTS)]

    def view(self, goal: Goal) -> ShopView:
        return ShopView(self.catalog.products, goal, self.search)


def load_shop() -> ShopData:
    """The catalog :class:`WebSettings` say to serve, and its search index (see :func:`shared_shop`)."""
    settings = WebSettings()
    if settings.catalog is not None and settings.attributes is not None:
        catalog = catalogs.load_webshop(settings.catalog, settings.attributes, settings.catalog_seed)
    else:
        catalog = catalogs.generate_catalog(settings.catalog_seed)
    passages = catalogs.product_passages(catalog.products.values())
    return ShopData(catalog, shared_retriever(passages, cache_root()))


SHARED = ProcessShared("web", load_shop, (CatalogFileError,))


def shared_shop() -> ShopData:
    """The process's shop, loaded by the first caller as :class:`WebSettings` say. Bad settings or
    unreadable WebShop files are an :class:`EnvFailure` whose message names the setting or file."""
    return SHARED.get()


class ShopOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    split: Literal["train", "dev", "test"] = Field(default="train", description="Which goals.")
    index: int | None = Field(
        default=None, ge=0, description="The goal's position in the split; none: the seed picks it."
    )
    start: Literal["search", "results"] = Field(
        default="search",
        description="Start on the search page (WebShop), or on the results of searching the "
        "instruction itself, so that an agent only clicks (a short task for small policies).",
    )


class ShopEnv(Env):
    """One shopping session. The seed picks the goal, ``seed % size of the split``, unless ``index``
    is given. ``info`` has the page's ``url`` (relative to ``/shop/<instance id>/``); after a
    purchase also the reward's parts (``r_type``, ``attributes_matched``, ...) and ``success``."""

    name = "shop"
    family = "web"
    instruction = INSTRUCTION
    action_format = "search[keywords] where the page has a search bar, or click[value] for a clickable"
    default_max_turns = 15
    reward_range = (0.0, 1.0)
    Options = ShopOptions
    agentgym_dialect = "webshop"
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py
    vocabulary_options = ({"start": "results"}, {})

    @classmethod
    def routers(cls) -> list[APIRouter]:
        """The shop's pages at ``/shop/<instance id>/`` (:mod:`.routes`)."""
        from env_server.envs.web.routes import router  # imports this module: resolved at call time

        return [router]

    @classmethod
    def prepare(cls) -> None:
        """Load the catalog and open (or build) its search index before the server listens."""
        shared_shop()

    def __init__(self, data: ShopData | None = None) -> None:
        self._data = data
        self.goal: Goal | None = None
        self.page: Page = START
        self.text = PageText("")
        self.html = ""
        self.history: list[tuple[str, bool]] = []  # (action, valid) of this episode, for the watch page

    @classmethod
    def agentgym_task(cls, data_idx: int) -> tuple[int, dict[str, Any] | None]:
        """AgentGym's session id: the test goals, then train's, then dev's."""
        goals = shared_shop().catalog.goals
        index = data_idx
        for split in AGENTGYM_ORDER:
            if index < len(goals[split]):
                return data_idx, {"split": split, "index": index}
            index -= len(goals[split])
        total = sum(len(goals[split]) for split in AGENTGYM_ORDER)
        raise ApiError(
            422, "invalid_options", f"session {data_idx} is past the {total} goals (0-{total - 1})"
        )

    @property
    def data(self) -> ShopData:
        if self._data is None:
            self._data = shared_shop()
        return self._data

    def reset(self, seed: int, options: ShopOptions) -> Observation:
        goals = self.data.catalog.goals[options.split]
        if options.index is not None and options.index >= len(goals):
            raise ApiError(
                422,
                "invalid_options",
                f"index {options.index} is past the {len(goals)} {options.split} goals",
            )
        index = seed % len(goals) if options.index is None else options.index
        self.goal = goals[index]
        self.history = []
        self._show(
            START if options.start == "search" else Page("results", query=self._query(self.goal.instruction))
        )
        info = {"split": options.split, "index": index, "asin": self.goal.asin, "url": self.page.path()}
        return Observation(self.text.observation, info)

    def step(self, action: str) -> Step:
        if self.goal is None:
            raise RuntimeError("reset the env before stepping it")
        parsed = ACTION.match(action)
        if parsed is None:
            step = self._invalid("an action is search[keywords] or click[value]")
        elif parsed[1].lower() == "search":
            step = self._search(parsed[2].strip())
        else:
            step = self._click(parsed[2].strip())
        self.history.append((action[:MAX_QUERY_CHARS], step.info["valid"]))
        return step

    def available_actions(self) -> list[str] | None:
        """``click[value]`` for every clickable; None on a page with a search bar (open text)."""
        if self.text.has_search_bar:
            return None
        return [f"click[{label.lower()}]" for label in self.clickables()]

    def clickables(self) -> list[str]:
        return [label for label, _ in self.text.clickables]

    @property
    def has_search_bar(self) -> bool:
        return self.text.has_search_bar

    def page_url(self) -> str:
        """The current page's URL relative to the shop root ``/shop/<instance id>/``."""
        return self.page.path()

    def page_html(self) -> str:
        """The current page's HTML as the agent's observation was read from it (no ``<base>``)."""
        return self.html

    def instruction_text(self) -> str:
        """The instruction as WebShop's ``get_instruction_text`` gives it."""
        assert self.goal is not None
        return f"Instruction: {self.goal.instruction}"

    def render(self, page: Page, base: str) -> str:
        """``page`` as HTML for this session's goal, with ``base`` as the shop root's URL path."""
        assert self.goal is not None
        return render(page, self.data.view(self.goal), base)

    def _show(self, page: Page) -> None:
        self.html = self.render(page, "")
        self.text = read_page(self.html)
        self.page = page

    def _query(self, text: str) -> str:
        return text[:MAX_QUERY_CHARS]

    def _search(self, query: str) -> Step:
        if not self.text.has_search_bar:
            return self._invalid("this page has no search bar: click[back to search] first")
        if not query_terms(query):
            return self._invalid("the search has no words to search for, e.g. search[blue wool socks]")
        truncated = len(query) > MAX_QUERY_CHARS
        self._show(Page("results", query=self._query(query)))
        return Step(
            self.text.observation,
            0.0,
            False,
            {"valid": True, "url": self.page.path(), "query_truncated": truncated},
        )

    def _click(self, value: str) -> Step:
        wanted = " ".join(value.split()).casefold()
        target = next((href for label, href in self.text.clickables if label.casefold() == wanted), None)
        if target is None:
            shown = ", ".join(self.clickables()) or "none"
            return self._invalid(f"{value[:80]!r} is not a clickable on this page; clickables: {shown}")
        if not target:  # the search page's button: it submits the search bar's text
            return self._invalid("type the search into the search bar: search[keywords]")
        page = follow(target, self.data.catalog.products)
        self._show(page)
        if page.kind != "done":
            return Step(self.text.observation, 0.0, False, {"valid": True, "url": page.path()})
        assert self.goal is not None
        score = score_purchase(page, self.data.view(self.goal))
        info = {
            "valid": True,
            "url": page.path(),
            "success": score.reward >= SUCCESS,
            "asin": page.asin,
            "options": dict(page.options),
            **score.as_info(),
        }
        return Step(self.text.observation, score.reward, True, info)

    def _invalid(self, why: str) -> Step:
        observation = f"Invalid action: {why}.\n\n{self.text.observation}"
        return Step(observation, 0.0, False, {"valid": False, "url": self.page.path()})
