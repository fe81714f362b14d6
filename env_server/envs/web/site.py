"""The shop's pages: where each one lives, its HTML, and the text an agent reads from that HTML.

A :class:`Page` is everything a page shows besides the goal: which kind it is, the search
query and results page, the product, the options chosen so far. It is a pure value: the same
page renders the same HTML, its URL (:meth:`Page.path`) gives it back (:func:`page_at`), and
pages are rendered from the URL alone, so a person can open any page of an agent's episode
in a browser and follow its links without touching the agent's state.

**One source of truth.** The agent does not get a second rendering of the page: its
observation is the text of the HTML (:func:`read_page`), its clickables are the page's links
and buttons, and clicking one follows the link's ``href`` back to a :class:`Page`. So what the
agent can click is exactly what a person sees, by construction (and the browser test checks it).

**URLs** (relative to ``/shop/<instance id>/``; every page has ``<base href>`` set to that):
``start``, ``search?q=&page=``, ``item/<asin>?q=&page=&o.<option>=<value>``,
``item/<asin>/<description|features|reviews>?…``, ``buy/<asin>?…`` (the purchase, scored
against the instance's goal; viewing it in a browser buys nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit

import jinja2

from env_server.envs.web.catalog import Goal, Product
from env_server.envs.web.reward import Score, purchase_score
from services.errors import ApiError

PageKind = Literal["start", "results", "item", "section", "done"]
SECTIONS = ("description", "features", "reviews")
RESULTS_PER_PAGE = 10  # WebShop's
MAX_RESULTS = 50  # WebShop's search returns its top 50
OPTION_PREFIX = "o."
SEPARATOR = " [SEP] "  # WebShop's text observation joins the page's texts with it

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(frozen=True)
class Page:
    """One page of the shop; ``options`` are the chosen ``(name, value)`` pairs in the product's order."""

    kind: PageKind
    query: str = ""
    page: int = 1
    asin: str = ""
    options: tuple[tuple[str, str], ...] = ()
    section: str = ""

    def path(self) -> str:
        """This page's URL relative to the shop's root."""
        if self.kind == "start":
            return "start"
        params: list[tuple[str, str]] = [("q", self.query), ("page", str(self.page))]
        if self.kind == "results":
            return f"search?{urlencode(params)}"
        params += [(OPTION_PREFIX + name, value) for name, value in self.options]
        where = {
            "item": f"item/{self.asin}",
            "section": f"item/{self.asin}/{self.section}",
            "done": f"buy/{self.asin}",
        }[self.kind]
        return f"{where}?{urlencode(params)}"

    def with_option(self, product: Product, name: str, value: str) -> Page:
        """The item page with ``name`` set to ``value``, the options kept in the product's order."""
        chosen = dict(self.options) | {name: value}
        return replace(self, options=tuple((n, chosen[n]) for n in product.options if n in chosen))


START = Page("start")


def page_at(
    path: str, params: Mapping[str, str] | Sequence[tuple[str, str]], products: Mapping[str, Product]
) -> Page:
    """The page a shop URL names (``path`` relative to the shop's root); 404 or 422 when it names none."""
    pairs = list(params.items()) if isinstance(params, Mapping) else list(params)
    values = dict(pairs)
    parts = [part for part in path.strip("/").split("/") if part]
    if parts in ([], ["start"]):
        return START
    query = values.get("q", "")
    try:
        number = int(values.get("page", "1"))
    except ValueError:
        raise ApiError(422, "invalid_page", f"page must be a whole number, got {values['page']!r}") from None
    if number < 1:
        raise ApiError(422, "invalid_page", f"page must be 1 or more, got {number}")
    if parts == ["search"]:
        return Page("results", query=query, page=number)
    if len(parts) not in (2, 3) or parts[0] not in ("item", "buy") or (parts[0] == "buy" and len(parts) == 3):
        raise ApiError(404, "not_found", f"the shop has no page {path!r}")
    product = products.get(parts[1])
    if product is None:
        raise ApiError(404, "not_found", f"the shop has no product {parts[1]!r}")
    options: list[tuple[str, str]] = []
    for key, value in pairs:
        if not key.startswith(OPTION_PREFIX):
            continue
        name = key.removeprefix(OPTION_PREFIX)
        if value not in product.options.get(name, ()):
            raise ApiError(422, "invalid_option", f"{product.asin} has no {name!r} option {value!r}")
        options.append((name, value))
    chosen = dict(options)
    ordered = tuple((name, chosen[name]) for name in product.options if name in chosen)
    base = Page("item", query=query, page=number, asin=product.asin, options=ordered)
    if parts[0] == "buy":
        return replace(base, kind="done")
    if len(parts) == 3:
        if parts[2] not in SECTIONS:
            raise ApiError(
                404, "not_found", f"an item page has no section {parts[2]!r}; sections: {', '.join(SECTIONS)}"
            )
        return replace(base, kind="section", section=parts[2])
    return base


@dataclass(frozen=True)
class ShopView:
    """What the pages need besides the page itself: the products, the search, the shopper's goal."""

    products: Mapping[str, Product]
    goal: Goal
    search: Callable[[str], list[Product]]  # the query's products, best first, at most MAX_RESULTS


def render(page: Page, view: ShopView, base: str) -> str:
    """The HTML of ``page`` for the shopper of ``view.goal``; ``base``: the shop root's URL path."""
    context: dict[str, object] = {"base": base, "goal": view.goal, "page": page, "back": START.path()}
    if page.kind == "start":
        return _TEMPLATES.get_template("start.html").render(context, title="")
    if page.kind == "results":
        found = view.search(page.query)
        pages = max(1, -(-len(found) // RESULTS_PER_PAGE))
        shown = found[(page.page - 1) * RESULTS_PER_PAGE : page.page * RESULTS_PER_PAGE]
        context |= {
            "total": len(found),
            "prev": replace(page, page=page.page - 1).path() if page.page > 1 else None,
            "next": replace(page, page=page.page + 1).path() if page.page < pages else None,
            "results": [
                (p, Page("item", query=page.query, page=page.page, asin=p.asin).path()) for p in shown
            ],
        }
        return _TEMPLATES.get_template("results.html").render(context, title=f"results for {page.query}")
    product = view.products[page.asin]
    item = replace(page, kind="item", section="")
    context["product"] = product
    if page.kind == "item":
        chosen = dict(page.options)
        context |= {
            "prev": Page("results", query=page.query, page=page.page).path(),
            "options": [
                (
                    name,
                    [(v, page.with_option(product, name, v).path(), chosen.get(name) == v) for v in values],
                )
                for name, values in product.options.items()
            ],
            "sections": [(s.capitalize(), replace(item, kind="section", section=s).path()) for s in SECTIONS],
            "buy": replace(item, kind="done").path(),
        }
        return _TEMPLATES.get_template("item.html").render(context, title=product.title)
    if page.kind == "section":
        lines = {
            "description": [product.description] if product.description else [],
            "features": list(product.features),
            "reviews": [f"{stars} out of 5 stars: {text}" for stars, text in product.reviews],
        }[page.section]
        context |= {"prev": item.path(), "heading": page.section.capitalize(), "lines": lines}
        return _TEMPLATES.get_template("section.html").render(context, title=product.title)
    context["score"] = score_purchase(page, view)
    return _TEMPLATES.get_template("done.html").render(context, title="purchase")


def render_watch(base: str, instance_id: str, path: str, turns: int) -> str:
    """The page that follows an agent's session (see :mod:`.routes`)."""
    context = {"base": base, "instance_id": instance_id, "path": path, "turns": turns}
    return _TEMPLATES.get_template("watch.html").render(context)


def score_purchase(page: Page, view: ShopView) -> Score:
    """The reward of the purchase a ``done`` page shows, for ``view.goal``."""
    product = view.products[page.asin]
    return purchase_score(product, dict(page.options), product.price, view.goal)


@dataclass
class PageText:
    """A page as an agent reads it: WebShop's text observation and the clickables with their links."""

    observation: str
    clickables: list[tuple[str, str]] = field(default_factory=list)  # (label, href), in page order
    has_search_bar: bool = False


class _PageReader(HTMLParser):
    """Texts of ``<body>`` in order (not ``<head>``, ``<style>``, ``<script>``), links and buttons."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: list[str] = []
        self.clickables: list[tuple[str, str]] = []
        self.has_search_bar = False
        self._in_body = False
        self._skip = 0
        self._link: tuple[str, list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "body":
            self._in_body = True
        elif tag in ("style", "script", "head"):
            self._skip += 1
        elif tag == "a":
            self._link = (attributes.get("href") or "", [])
        elif tag == "button":
            self._link = ("", [])
        elif tag == "input" and attributes.get("name") == "q":
            self.has_search_bar = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("style", "script", "head"):
            self._skip -= 1
        elif tag in ("a", "button") and self._link is not None:
            href, words = self._link
            label = " ".join(" ".join(words).split())
            if label:
                self.clickables.append((label, href))
                self.texts.append(label)
            self._link = None

    def handle_data(self, data: str) -> None:
        if not self._in_body or self._skip:
            return
        if self._link is not None:
            self._link[1].append(data)
            return
        text = " ".join(data.split())
        if text:
            self.texts.append(text)


def read_page(html: str) -> PageText:
    """What an agent reads of ``html``: its texts joined by ``[SEP]``, and its clickables."""
    reader = _PageReader()
    reader.feed(html)
    reader.close()
    return PageText(SEPARATOR.join(reader.texts), reader.clickables, reader.has_search_bar)


def follow(href: str, products: Mapping[str, Product]) -> Page:
    """The page a link of the shop's HTML leads to (a relative URL as :meth:`Page.path` writes it)."""
    parts = urlsplit(href)
    return page_at(parts.path, parse_qsl(parts.query, keep_blank_values=True), products)
