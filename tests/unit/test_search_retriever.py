"""The search family's retriever: ranking, hostile queries, the on-disk index cache, sharing."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import pytest

from env_server.envs.search import retriever as retriever_module
from env_server.envs.search.corpus import Passage
from env_server.envs.search.retriever import MAX_QUERY_TERMS, Retriever, query_terms, shared_retriever

FACTS = [
    Passage(id="country:GE", title="Georgia", text="Georgia is a country in Asia. Its capital is Tbilisi."),
    Passage(id="state:GA", title="Georgia", text="Georgia is a U.S. state. Its capital is Atlanta."),
    Passage(id="city:tbilisi", title="Tbilisi", text="Tbilisi is the capital of Georgia, on the Kura river."),
    Passage(id="city:embarcacion", title="Embarcación", text="Embarcación is a city in Salta, Argentina."),
    Passage(id="currency:GEL", title="Georgian lari", text="The lari is the currency of Georgia (GEL)."),
    Passage(id="element:Fe", title="Iron", text="Iron is a chemical element discovered before 5000 BC."),
]


def corpus(size: int = 300) -> list[Passage]:
    """The facts above among ``size`` filler passages that share their common words."""
    filler = [
        Passage(
            id=f"filler:{n}", title=f"Town {n}", text=f"Town {n} is a city in Region {n % 17} of a country."
        )
        for n in range(size - len(FACTS))
    ]
    return [*filler[: size // 2], *FACTS, *filler[size // 2 :]]


@pytest.fixture(scope="module")
def retriever() -> Retriever:
    return Retriever(corpus())


def ids(passages: list[Passage]) -> list[str]:
    return [passage.id for passage in passages]


def test_best_match_first_and_k_bounds_the_list(retriever: Retriever) -> None:
    assert ids(retriever.search("capital of the country Georgia", 1)) == ["country:GE"]
    assert ids(retriever.search("Tbilisi", 2)) == ["city:tbilisi", "country:GE"]  # title hit first
    assert len(retriever.search("city", 10)) == 10
    assert retriever.search("Tbilisi", 0) == []


def test_a_title_match_outranks_a_mention() -> None:
    mention = Passage(
        id="m", title="Rivers", text="Kura flows through Tbilisi and other cities in the valley."
    )
    titled = Passage(
        id="t", title="Kura", text="A river of the Caucasus that flows to the Caspian Sea, far away."
    )
    assert ids(Retriever([mention, titled]).search("Kura", 2)) == ["t", "m"]


def test_stemming_case_and_accents_are_forgiven(retriever: Retriever) -> None:
    assert ids(retriever.search("EMBARCACION", 1)) == ["city:embarcacion"]  # folded to ASCII
    assert ids(retriever.search("currencies", 1)) == ["currency:GEL"]  # only it says "currency"
    assert ids(retriever.search("discovering", 1)) == ["element:Fe"]  # only it says "discovered"


@pytest.mark.parametrize(
    "query",
    [
        'title:Tbilisi AND (capital OR "Kura',  # tantivy's query syntax, unbalanced
        "Tbilisi^3 -Georgia +capital ~2 *",
        "Tbilisi\x00\x01\x7f\ufffd\u200b",
        "NOT Tbilisi",  # an operator when upper case; a word here
    ],
)
def test_query_syntax_and_control_characters_are_plain_words(retriever: Retriever, query: str) -> None:
    assert "city:tbilisi" in ids(retriever.search(query, 3))


@pytest.mark.parametrize("query", ["", "   ", "?!:()[]{}\"'*^~+-", "\x00\x01\x02\x1b", "___"])
def test_a_query_without_words_finds_nothing(retriever: Retriever, query: str) -> None:
    assert query_terms(query) == []
    assert retriever.search(query, 5) == []


def test_a_100kb_query_uses_its_first_words(retriever: Retriever) -> None:
    query = "Embarcación Salta " + "lorem ipsum " * 8_500
    assert len(query) > 100_000 and len(query_terms(query)) > MAX_QUERY_TERMS
    started = time.perf_counter()
    found = retriever.search(query, 1)
    assert time.perf_counter() - started < 1.0  # ~2 ms measured; bounded by MAX_QUERY_TERMS
    assert ids(found) == ["city:embarcacion"]
    cut = " ".join(["lorem"] * MAX_QUERY_TERMS + ["Embarcación"])
    assert "city:embarcacion" not in ids(retriever.search(cut, 5))  # a word past the limit is unused


def test_results_are_deterministic_across_builds(retriever: Retriever, tmp_path: Path) -> None:
    queries = ["Georgia", "capital", "city in a country", "Town 7 Region"]
    rebuilt = Retriever(corpus(), tmp_path)
    for query in queries:
        assert ids(rebuilt.search(query, 10)) == ids(retriever.search(query, 10))


def test_the_index_is_cached_on_disk_by_corpus_and_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Retriever(corpus(), tmp_path)
    [folder] = (tmp_path / "search" / "index").iterdir()
    assert folder.name == first.folder_name()
    assert first.key[:32] in folder.name and f"tantivy-{version('tantivy')}" in folder.name

    def no_build(*_: object) -> None:
        raise AssertionError("the cached index was built again")

    monkeypatch.setattr(retriever_module, "_build", no_build)
    again = Retriever(corpus(), tmp_path)
    assert ids(again.search("Tbilisi", 3)) == ids(first.search("Tbilisi", 3))
    monkeypatch.undo()
    Retriever(corpus(301), tmp_path)  # another corpus, another folder
    assert len(list((tmp_path / "search" / "index").iterdir())) == 2


def test_a_damaged_cached_index_is_rebuilt(tmp_path: Path) -> None:
    small = Retriever(FACTS, tmp_path)
    folder = tmp_path / "search" / "index" / small.folder_name()
    # Another corpus's index under this corpus's name: its passage count gives it away.
    other = Retriever(corpus(), tmp_path / "other")
    for path in folder.iterdir():
        path.unlink()
    for path in (tmp_path / "other" / "search" / "index" / other.folder_name()).iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    assert ids(Retriever(FACTS, tmp_path).search("Tbilisi", 1)) == ["city:tbilisi"]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left
    (folder / "meta.json").unlink()  # a folder tantivy cannot open at all is rebuilt too
    assert ids(Retriever(FACTS, tmp_path).search("Tbilisi", 1)) == ["city:tbilisi"]


def test_one_shared_retriever_per_corpus_safe_across_threads(tmp_path: Path) -> None:
    passages = corpus(500)
    with ThreadPoolExecutor(8) as pool:
        shared = list(pool.map(lambda _: shared_retriever(passages, tmp_path), range(8)))
    assert all(r is shared[0] for r in shared)
    assert shared_retriever(corpus(500), tmp_path) is shared[0]  # equal passages, same retriever
    queries = [f"Town {n} Region {n % 17}" for n in range(200)]
    expected = [ids(shared[0].search(q, 5)) for q in queries]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda q: ids(shared[0].search(q, 5)), queries)) == expected


def test_an_empty_corpus_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one passage"):
        Retriever([])
