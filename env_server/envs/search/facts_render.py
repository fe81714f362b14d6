"""The facts of a :class:`World` as Wikipedia-like passages, one per entity.

Ids are ``kind:key`` with keys the sources' own stable codes (``country:GE``, ``city:611717``,
``region:GE-IM``, ``element:70``), so an id names the same entity in every build. Titles are
plain entity names, as a search engine shows them: the corpus keeps every same-name entity
(the country Georgia and the U.S. state, the 35 capitals that other cities are named after, the
city Tbilisi and the ISO region Tbilisi) and only the text tells them apart.

A passage names the passage each relation leads to by that passage's exact title (a country's
text says "Its capital is Brasília", the city's own title, not GeoNames' "Brasilia"), which is
what lets a question's evidence chain be checked by string containment.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from env_server.envs.search.corpus import Passage
from env_server.envs.search.facts_world import (
    MIN_CITY_POPULATION,
    City,
    Continent,
    Country,
    Currency,
    Element,
    Language,
    Region,
    State,
    World,
)

KINDS = ("country", "city", "region", "state", "continent", "currency", "language", "element")


def pid(kind: str, key: object) -> str:
    """The passage id of an entity."""
    return f"{kind}:{key}"


def kind_of(passage_id: str) -> str:
    return passage_id.split(":", 1)[0]


def listing(names: list[str]) -> str:
    """ "A", "A and B", "A, B and C"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def capital_name(world: World, country: Country) -> str:
    """The capital as its city passage is titled, else as GeoNames spells it."""
    return world.cities[country.capital_city].name if country.capital_city else country.capital


def render(world: World) -> list[Passage]:
    """Every passage of the corpus, in id order within each kind."""
    return list(_passages(world))


def _passages(world: World) -> Iterator[Passage]:
    for country in world.countries.values():
        yield Passage(id=pid("country", country.code), title=country.name, text=_country(world, country))
    for city in world.cities.values():
        yield Passage(id=pid("city", city.id), title=city.name, text=_city(world, city))
    for region in world.regions.values():
        yield Passage(id=pid("region", region.code), title=region.name, text=_region(world, region))
    per_state = Counter(city.state for city in world.cities.values() if city.state)
    for state in world.states.values():
        yield Passage(id=pid("state", state.code), title=state.name, text=_state(world, state, per_state))
    for continent in world.continents.values():
        yield Passage(
            id=pid("continent", continent.code), title=continent.name, text=_continent(world, continent)
        )
    for currency in world.currencies.values():
        yield Passage(id=pid("currency", currency.code), title=currency.name, text=_currency(world, currency))
    for language in world.languages.values():
        yield Passage(id=pid("language", language.code), title=language.name, text=_language(world, language))
    for element in world.elements.values():
        yield Passage(id=pid("element", element.number), title=element.name, text=_element(world, element))


def _country(world: World, country: Country) -> str:
    where = world.continents[country.continent].name
    if country.subregion:
        where += f" ({country.subregion})"
    parts = [f"{country.name} is a country in {where}."]
    if country.capital:
        capital = capital_name(world, country)
        if country.largest_city == country.capital_city:
            parts.append(f"Its capital and largest city is {capital}.")
        elif country.largest_city:
            parts.append(
                f"Its capital is {capital} and its largest city is {world.cities[country.largest_city].name}."
            )
        else:
            parts.append(f"Its capital is {capital}.")
    if country.population:
        parts.append(f"It has a population of {country.population:,}")
        parts[-1] += f" and an area of {country.area_km2:,.0f} km²." if country.area_km2 else "."
    if country.currency:
        parts.append(f"Its currency is the {world.currencies[country.currency].name}.")
    if country.languages:
        names = [world.languages[code].name for code in country.languages]
        parts.append(f"Languages spoken there include {listing(names)}.")
    if country.neighbours:
        parts.append(f"It borders {listing([world.countries[n].name for n in country.neighbours])}.")
    if country.demonym:
        parts.append(f"Its people are called {country.demonym}.")
    if country.calling_code:
        parts.append(f"Its calling code is +{country.calling_code}.")
    if country.tld:
        parts.append(f"Its internet domain is {country.tld}.")
    return " ".join(parts)


def _city(world: World, city: City) -> str:
    country = world.countries[city.country]
    roles = []
    if country.capital_city == city.id:
        roles.append(f"the capital of {country.name}")
    if country.largest_city == city.id:
        roles.append(f"the largest city of {country.name}" if not roles else "its largest city")
    if city.state:
        state = world.states[city.state]
        where = f"a city in the U.S. state of {state.name}, {country.name}"
        if state.largest_city == city.id:
            where += ", and the state's largest city"
        roles.append(where)
    elif not roles:
        roles.append(f"a city in {country.name}")
    latitude = f"{abs(city.latitude):.2f}°{'N' if city.latitude >= 0 else 'S'}"
    longitude = f"{abs(city.longitude):.2f}°{'E' if city.longitude >= 0 else 'W'}"
    return (
        f"{city.name} is {listing(roles)}, with a population of {city.population:,}. "
        f"It lies at {latitude} {longitude}."
    )


def _region(world: World, region: Region) -> str:
    text = f"{region.name} is {article(region.kind)} {region.kind} of {world.countries[region.country].name}"
    text += f" (ISO 3166-2 code {region.code})"
    return text + (f", part of {region.parent}." if region.parent else ".")


def _state(world: World, state: State, per_state: Counter[str]) -> str:
    what = "the federal district" if state.code == "DC" else "a state"
    text = f"{state.name} is {what} of the United States (postal abbreviation {state.code})."
    if state.largest_city:
        text += (
            f" Its largest city is {world.cities[state.largest_city].name}, one of its {per_state[state.code]} cities"
            f" of at least {MIN_CITY_POPULATION:,} inhabitants."
        )
    return text


def _continent(world: World, continent: Continent) -> str:
    parts = [f"{continent.name} is one of the seven continents."]
    if continent.most_populous:
        parts.append(f"Its most populous country is {world.countries[continent.most_populous].name}.")
    if continent.largest_city:
        city = world.cities[continent.largest_city]
        parts.append(f"Its largest city is {city.name}, in {world.countries[city.country].name}.")
    names = [world.countries[code].name for code in continent.countries]
    parts.append(f"Its {len(names)} countries and territories are {listing(names)}.")
    return " ".join(parts)


def _currency(world: World, currency: Currency) -> str:
    users = [world.countries[code].name for code in currency.countries]
    return (
        f"The {currency.name} (ISO 4217 code {currency.code}, numeric code {currency.numeric}) is the currency"
        f" of {listing(users)}."
    )


def _language(world: World, language: Language) -> str:
    codes = f"ISO 639-3 code {language.code}"
    if language.alpha_2:
        codes += f", ISO 639-1 code {language.alpha_2}"
    users = [world.countries[code].name for code in language.countries]
    return f"{language.name} ({codes}) is a language spoken in {listing(users)}."


def _element(world: World, element: Element) -> str:
    where = f"period {element.period}" + (f" and group {element.group}" if element.group else "")
    parts = [
        f"{element.name} (symbol {element.symbol}) is the chemical element with atomic number {element.number},"
        f" in {where} of the periodic table"
        + (f", one of the {element.series.lower()}." if element.series else ".")
    ]
    parts.append(f"Its standard atomic weight is {element.weight:g}.")
    if element.discoverers.startswith("Known to the ancients"):
        parts.append("It has been known since ancient times.")
    elif element.discoverers:
        found = (
            "It was discovered"
            + (f" in {element.year}" if element.year else "")
            + f" by {element.discoverers}"
        )
        if element.place:
            country = world.countries[element.country].name if element.country else element.place
            # "in England, United Kingdom": the country passage's title, for the next hop.
            found += f" in {element.place}" if country == element.place else f" in {element.place}, {country}"
        parts.append(found + ".")
    for extra in (element.name_origin.strip(), element.description.strip()):
        if extra:
            parts.append(extra if extra.endswith((".", "!", "?")) else f"{extra}.")
    return " ".join(parts)
