"""Single-hop and 2-4-hop questions over the rendered facts, each with its evidence chain.

A multi-hop question is a *start* that names a country indirectly ("the country whose capital is
Tbilisi", one passage: Tbilisi's) followed by an *ending* that asks about that country, possibly
through more passages ("the ISO 4217 code of the currency of ...": Georgia's passage, then the
Lari's). The evidence is the passages in hop order and ``hops`` their number, so "What is the ISO
4217 code of the currency of the country whose capital is Tbilisi?" has evidence
``[city:611717, country:GE, currency:GEL]`` and 3 hops.

Unambiguous by construction: every passage of a chain has a title no other passage *of its kind*
shares (two cities called Kingston: no question starts from either; the country Georgia and the
U.S. state may both exist, the question says which kind it means), a "country whose capital is X"
is the only country with a capital of that name, and "the only country that borders X" is asked
only where X has one neighbour. Each passage of a chain contains the title of the next one and the
last contains the answer, which is what tests/unit/test_search_facts.py checks for every question.

Selection caps each template at :data:`TEMPLATE_CAP` questions and each answer within a template
at :data:`ANSWER_CAP` (without it "United States" would answer a tenth of the city questions),
taking entities in the order of a SHA-256 of their passage id: deterministic, spread over the data,
and the same order for every template, so that the templates of a start share their entities (a
split by entity then keeps all of an entity's questions together) and a start whose country has
had :data:`ANSWER_CAP` starts of its kind already is skipped without generating its endings (each
ending's answer depends on the country alone, so it could only add answers at their cap): 0.8 s
instead of 3.4 s for all 355,000 candidates, with the same number of questions per template.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from env_server.envs.search.corpus import Passage, Question
from env_server.envs.search.facts_render import capital_name, kind_of, pid
from env_server.envs.search.facts_world import Country, World, fold

TEMPLATE_CAP = 500
ANSWER_CAP = 10
MAX_HOPS = 4

K = TypeVar("K", str, int)
E = TypeVar("E")


@dataclass(frozen=True)
class Start:
    """A way to name a country: the phrase and the passages that resolve it (none for its name)."""

    kind: str
    phrase: str
    evidence: tuple[str, ...]
    country: Country


@dataclass(frozen=True)
class Draft:
    template: str
    question: str
    answers: tuple[str, ...]
    evidence: tuple[str, ...]


def stable_hash(text: str) -> int:
    """A 64-bit digest that, unlike ``hash()``, is the same in every process."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


class QuestionMaker:
    def __init__(self, world: World, passages: list[Passage]) -> None:
        self.world = world
        self.rank = {p.id: (stable_hash(f"order/{p.id}"), p.id) for p in passages}
        per_title = Counter((kind_of(p.id), p.title) for p in passages)
        self.unique = {p.id for p in passages if per_title[kind_of(p.id), p.title] == 1}
        self.capitals = Counter(fold(c.capital) for c in world.countries.values() if c.capital)
        self.shared_titles = {title for title, n in Counter(p.title for p in passages).items() if n > 1}
        # "the city of X" must name one country: ISO regions of kind "city" (Tbilisi) count too.
        self.city_countries: dict[str, set[str]] = {}
        for city in world.cities.values():
            self.city_countries.setdefault(city.name, set()).add(city.country)
        for region in world.regions.values():
            if region.kind == "city":
                self.city_countries.setdefault(region.name, set()).add(region.country)

    def questions(self) -> list[Question]:
        """The selected questions, in the order of a hash of their ids (templates and entities mixed,
        so that consecutive seeds do not ask about one entity)."""
        kept: Counter[str] = Counter()
        per_answer: Counter[tuple[str, str]] = Counter()
        asked: set[str] = set()
        chosen: list[Question] = []
        for draft in self._drafts():
            template, chain, answer = draft.template, draft.evidence, draft.answers[0]
            if kept[template] == TEMPLATE_CAP or per_answer[template, answer] == ANSWER_CAP:
                continue
            looping = len(set(chain)) != len(chain)
            if (
                looping
                or len(chain) > MAX_HOPS
                or draft.question in asked
                or not self.unique.issuperset(chain)
            ):
                continue
            asked.add(draft.question)
            kept[template] += 1
            per_answer[template, answer] += 1
            chosen.append(
                Question(
                    id=f"{template}/{chain[0]}",  # one question per template and first passage
                    question=draft.question,
                    answers=list(draft.answers),
                    hops=len(chain),
                    evidence=list(chain),
                )
            )
        return sorted(chosen, key=lambda q: (stable_hash(q.id), q.id))

    def _ordered(self, kind: str, entities: dict[K, E]) -> list[E]:
        """``entities`` (keyed as their passage ids are) in the shared selection order."""
        return [entities[key] for key in sorted(entities, key=lambda key: self.rank[pid(kind, key)])]

    def _drafts(self) -> Iterator[Draft]:
        yield from self._single_hop()
        yield from self._states()
        starts: Counter[tuple[str, str]] = Counter()
        for start in self._starts():
            if start.evidence:  # a named country needs no skipping: one start each
                # Later starts of this kind and country could only add answers at their cap (module
                # docstring), up to a question text two starts share, which is asked once anyway.
                if starts[start.kind, start.country.code] == ANSWER_CAP:
                    continue
                starts[start.kind, start.country.code] += 1
            yield from self._endings(start)

    # -- starts: ways to name a country --------------------------------------------------------

    def _starts(self) -> Iterator[Start]:
        w = self.world
        for country in self._ordered("country", w.countries):
            # The U.S. state Georgia has a capital too: a name other passages share gets its kind.
            name = f"the country of {country.name}" if country.name in self.shared_titles else country.name
            yield Start("country", name, (), country)
        for city in self._ordered("city", w.cities):
            if len(self.city_countries[city.name]) > 1 or pid("city", city.id) not in self.unique:
                continue
            country = w.countries[city.country]
            if country.capital_city == city.id:
                if self.capitals[fold(country.capital)] == 1:
                    yield Start(
                        "capital",
                        f"the country whose capital is {city.name}",
                        (pid("city", city.id),),
                        country,
                    )
            else:
                yield Start(
                    "city",
                    f"the country in which the city of {city.name} lies",
                    (pid("city", city.id),),
                    country,
                )
        for region in self._ordered("region", w.regions):
            if region.kind == "city" and len(self.city_countries[region.name]) > 1:
                continue
            if pid("region", region.code) not in self.unique:
                continue
            phrase = f"the country in which the {region.kind} of {region.name} lies"
            yield Start("region", phrase, (pid("region", region.code),), w.countries[region.country])
        for element in self._ordered("element", w.elements):
            if element.country:
                phrase = f"the country where {element.name.lower()} was discovered"
                yield Start(
                    "element", phrase, (pid("element", element.number),), w.countries[element.country]
                )
        for currency in self._ordered("currency", w.currencies):
            if len(currency.countries) == 1:
                phrase = f"the country whose currency is the {currency.name}"
                yield Start(
                    "currency", phrase, (pid("currency", currency.code),), w.countries[currency.countries[0]]
                )

    # -- endings: what is asked about the country a start names --------------------------------

    def _endings(self, start: Start) -> Iterator[Draft]:
        w, country, via, phrase = self.world, start.country, start.evidence, start.phrase
        here = (*via, pid("country", country.code))

        def draft(ending: str, question: str, answers: tuple[str, ...], chain: tuple[str, ...]) -> Draft:
            return Draft(f"{start.kind}>{ending}", question, answers, chain)

        if country.capital and start.kind != "capital":
            yield draft("capital", f"What is the capital of {phrase}?", self._capital_answers(country), here)
            if country.capital_city:
                city = w.cities[country.capital_city]
                question = f"What is the population of the capital of {phrase}?"
                yield draft(
                    "capital-population", question, _number(city.population), (*here, pid("city", city.id))
                )
        if country.currency and start.kind != "currency":
            currency = w.currencies[country.currency]
            yield draft("currency", f"What is the currency of {phrase}?", currency.aliases, here)
            question = f"What is the ISO 4217 code of the currency of {phrase}?"
            yield draft("currency-code", question, (currency.code,), (*here, pid("currency", currency.code)))
        continent = w.continents[country.continent]
        yield draft("continent", f"On which continent is {phrase}?", (continent.name,), here)
        if continent.most_populous:
            big = w.countries[continent.most_populous]
            on = (*here, pid("continent", continent.code))
            question = f"What is the most populous country on the continent of {phrase}?"
            yield draft("continent-populous", question, big.aliases, on)
            if big.capital:
                question = f"What is the capital of the most populous country on the continent of {phrase}?"
                yield draft(
                    "continent-populous-capital",
                    question,
                    self._capital_answers(big),
                    (*on, pid("country", big.code)),
                )
        if len(country.neighbours) == 1:
            neighbour = w.countries[country.neighbours[0]]
            beyond = (*here, pid("country", neighbour.code))
            only = f"the only country that borders {phrase}"
            if neighbour.capital:
                yield draft(
                    "neighbour-capital",
                    f"What is the capital of {only}?",
                    self._capital_answers(neighbour),
                    beyond,
                )
            if neighbour.capital_city:
                city = w.cities[neighbour.capital_city]
                question = f"What is the population of the capital of {only}?"
                yield draft(
                    "neighbour-capital-population",
                    question,
                    _number(city.population),
                    (*beyond, pid("city", city.id)),
                )
            if neighbour.currency:
                question = f"What is the ISO 4217 code of the currency of {only}?"
                chain = (*beyond, pid("currency", neighbour.currency))
                yield draft("neighbour-currency-code", question, (neighbour.currency,), chain)

    def _capital_answers(self, country: Country) -> tuple[str, ...]:
        return tuple(dict.fromkeys((capital_name(self.world, country), country.capital)))

    # -- single-hop facts and the U.S. states ---------------------------------------------------

    def _single_hop(self) -> Iterator[Draft]:
        w = self.world
        for city in self._ordered("city", w.cities):
            chain = (pid("city", city.id),)
            if len(self.city_countries[city.name]) == 1:
                question = f"In which country is the city of {city.name}?"
                yield Draft("city>country", question, w.countries[city.country].aliases, chain)
            question = f"What is the population of the city of {city.name}?"
            yield Draft("city>population", question, _number(city.population), chain)
        for region in self._ordered("region", w.regions):
            if region.kind == "city" and len(self.city_countries[region.name]) > 1:
                continue
            question = f"In which country is the {region.kind} of {region.name}?"
            yield Draft(
                "region>country", question, w.countries[region.country].aliases, (pid("region", region.code),)
            )
        for currency in self._ordered("currency", w.currencies):
            chain = (pid("currency", currency.code),)
            yield Draft(
                "currency>code", f"What is the ISO 4217 code of the {currency.name}?", (currency.code,), chain
            )
        for language in self._ordered("language", w.languages):
            question = f"What is the ISO 639-3 code of the {language.name} language?"
            yield Draft("language>code", question, (language.code,), (pid("language", language.code),))
        for element in self._ordered("element", w.elements):
            chain = (pid("element", element.number),)
            name = element.name.lower()
            yield Draft("element>symbol", f"What is the chemical symbol of {name}?", (element.symbol,), chain)
            if element.discoverers and not element.discoverers.startswith("Known to the ancients"):
                yield Draft("element>discoverer", f"Who discovered {name}?", (element.discoverers,), chain)
            if element.year:
                yield Draft(
                    "element>year", f"In which year was {name} discovered?", (str(element.year),), chain
                )
            if element.country:
                question = f"In which country was {name} discovered?"
                answers = tuple(dict.fromkeys((*w.countries[element.country].aliases, element.place)))
                yield Draft("element>country", question, answers, chain)  # "England" is right too

    def _states(self) -> Iterator[Draft]:
        w = self.world
        for state in self._ordered("state", w.states):
            if state.largest_city:
                question = f"What is the largest city of the U.S. state of {state.name}?"
                answer = (w.cities[state.largest_city].name,)
                yield Draft("state>largest-city", question, answer, (pid("state", state.code),))
        for city in self._ordered("city", w.cities):
            if not city.state:
                continue
            state = w.states[city.state]
            chain = (pid("city", city.id), pid("state", state.code))
            yield Draft(
                "us-city>state", f"In which U.S. state is the city of {city.name}?", (state.name,), chain[:1]
            )
            if state.largest_city and state.largest_city != city.id:
                largest = w.cities[state.largest_city]
                of = f"the U.S. state in which the city of {city.name} lies"
                yield Draft(
                    "us-city>largest-city", f"What is the largest city of {of}?", (largest.name,), chain
                )
                question = f"What is the population of the largest city of {of}?"
                yield Draft(
                    "us-city>largest-city-population",
                    question,
                    _number(largest.population),
                    (*chain, pid("city", largest.id)),
                )


def _number(value: int) -> tuple[str, ...]:
    """A count as passages print it and as digits alone (both normalise alike; both read as answers)."""
    return (f"{value:,}", str(value)) if value >= 1000 else (str(value),)


def make_questions(world: World, passages: list[Passage]) -> list[Question]:
    """The generated questions over ``passages`` (the rendering of ``world``)."""
    return QuestionMaker(world, passages).questions()
