"""The search family's datasets: the generated real-facts corpus and questions, and a user's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from env_server.envs.search.corpus import CorpusFileError, Passage
from env_server.envs.search.facts import (
    DEFAULT_SPLITS,
    Dataset,
    dataset_key,
    default_dataset,
    load_dataset,
    split_of,
)
from env_server.envs.search.facts_questions import MAX_HOPS
from env_server.envs.search.facts_render import KINDS, kind_of

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stargym-cache")


@pytest.fixture(scope="module")
def dataset(cache_dir: Path) -> Dataset:
    return default_dataset(cache_dir)  # built here (cold), read back by test_second_load_reads_the_cache


@pytest.fixture(scope="module")
def by_id(dataset: Dataset) -> dict[str, Passage]:
    return {passage.id: passage for passage in dataset.passages}


def all_questions(dataset: Dataset):
    return [question for split in DEFAULT_SPLITS for question in dataset.questions[split]]


def test_corpus_is_large_with_unique_ids_and_every_kind(dataset: Dataset, by_id: dict[str, Passage]) -> None:
    assert len(dataset.passages) >= 30_000
    assert len(by_id) == len(dataset.passages), "passage ids are unique"
    assert set(Counter(kind_of(p.id) for p in dataset.passages)) == set(KINDS)
    assert all(p.title and p.text.startswith(("The ", p.title)) for p in dataset.passages)


def test_same_name_distractors_are_kept(dataset: Dataset, by_id: dict[str, Passage]) -> None:
    georgias = {p.id for p in dataset.passages if p.title == "Georgia"}
    assert {"country:GE", "state:GA"} <= georgias
    titles = Counter(p.title for p in dataset.passages)
    capitals = [p for p in dataset.passages if p.id.startswith("city:") and " is the capital of " in p.text]
    assert sum(titles[p.title] > 1 for p in capitals) >= 30, "cities named like capitals"
    assert "Tbilisi" in by_id["country:GE"].text and "Lari" in by_id["country:GE"].text


def test_every_chain_is_in_the_corpus(dataset: Dataset, by_id: dict[str, Passage]) -> None:
    """Each passage names the next one by its title; the first is named in the question; the last
    holds the answer. Checked for every question (~11,000; < 0.5 s)."""
    for question in all_questions(dataset):
        chain = [by_id[pid] for pid in question.evidence]
        assert 1 <= question.hops == len(chain) <= MAX_HOPS, question
        assert chain[0].title.lower() in question.question.lower(), question
        for here, there in pairwise(chain):
            assert there.title in here.text, (question, here.id, there.id)
        assert question.answers[0] in chain[-1].text, question


def test_chains_are_unambiguous(dataset: Dataset) -> None:
    """No other passage of the same kind shares a chain passage's title, and no question repeats."""
    per_kind = Counter((kind_of(p.id), p.title) for p in dataset.passages)
    titles = {p.id: p.title for p in dataset.passages}
    questions = all_questions(dataset)
    for question in questions:
        for pid in question.evidence:
            assert per_kind[kind_of(pid), titles[pid]] == 1, (question, pid)
    assert len({q.question for q in questions}) == len({q.id for q in questions}) == len(questions)


def test_splits_are_disjoint_by_entity_stable_and_have_every_hop_count(dataset: Dataset) -> None:
    """No two splits share a question or a start entity (a question's first passage)."""
    seen: set[str] = set()
    sizes = {split: len(dataset.questions[split]) for split in DEFAULT_SPLITS}
    for split in DEFAULT_SPLITS:
        members = dataset.questions[split]
        starts = {q.evidence[0] for q in members}
        assert not starts & seen
        seen |= starts
        assert all(split_of(q.evidence[0]) == split for q in members)
        assert {q.hops for q in members} == set(range(1, MAX_HOPS + 1)), split
    total = sum(sizes.values())
    assert total > 8_000
    assert 0.75 < sizes["train"] / total < 0.85 and 0.07 < sizes["test"] / total < 0.13, sizes
    # A pinned value: the split function (SHA-256 of the text) must not change under anyone's data.
    assert [split_of(f"question {i}") for i in range(4)] == ["train", "test", "train", "test"]


def test_known_multi_hop_question(dataset: Dataset) -> None:
    questions = {q.question: q for q in all_questions(dataset)}
    currency = questions["What is the currency of the country whose capital is Tbilisi?"]
    assert currency.evidence == ["city:611717", "country:GE"] and currency.hops == 2
    assert {"Lari", "Georgian Lari"} <= set(currency.answers)
    code = questions["What is the ISO 4217 code of the currency of the country whose capital is Tbilisi?"]
    assert code.evidence == ["city:611717", "country:GE", "currency:GEL"] and code.answers == ["GEL"]


def test_second_load_reads_the_cache(dataset: Dataset, cache_dir: Path) -> None:
    folder = cache_dir / "search" / f"facts-{dataset_key()}"
    assert sorted(p.name for p in folder.iterdir()) == [
        "dev.jsonl",
        "passages.jsonl",
        "test.jsonl",
        "train.jsonl",
    ]
    assert default_dataset(cache_dir) == dataset


def test_same_versions_give_byte_identical_files(dataset: Dataset, cache_dir: Path, tmp_path: Path) -> None:
    """A fresh build in another process (another hash seed) writes the same bytes as the cache."""
    script = (
        "import sys; from pathlib import Path; from env_server.envs.search.facts import default_dataset;"
        " default_dataset(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env, check=True, timeout=120)
    ours = cache_dir / "search" / f"facts-{dataset_key()}"
    theirs = tmp_path / "search" / f"facts-{dataset_key()}"
    for name in ("passages.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def users_files(tmp_path: Path) -> tuple[Path, Path]:
    """A HotpotQA-like export: extra fields (``_id``, ``type``, ``url``) stay out of the way."""
    corpus = write_lines(
        tmp_path / "corpus.jsonl",
        [
            json.dumps({"id": f"doc{i}", "title": f"Title {i}", "text": f"Text {i}.", "url": "x"})
            for i in range(5)
        ],
    )
    questions = write_lines(
        tmp_path / "qa.jsonl",
        [
            json.dumps(
                {"_id": str(i), "question": f"What is item {i}?", "answers": [f"item {i}"], "type": "x"}
            )
            for i in range(60)
        ],
    )
    return corpus, questions


def test_users_files_round_trip(tmp_path: Path) -> None:
    corpus, questions = users_files(tmp_path)
    loaded = load_dataset(corpus, questions)
    assert [p.id for p in loaded.passages] == [f"doc{i}" for i in range(5)]
    texts = [q.question for split in DEFAULT_SPLITS for q in loaded.questions[split]]
    assert sorted(texts) == sorted(f"What is item {i}?" for i in range(60))
    assert all(loaded.questions[split] for split in DEFAULT_SPLITS)
    assert load_dataset(corpus, questions) == loaded


@pytest.mark.parametrize(
    ("which", "line", "message"),
    [
        ("corpus", "{not json", "corpus.jsonl:3: not a Passage"),
        ("corpus", json.dumps({"id": "", "title": "t", "text": "x"}), "corpus.jsonl:3: not a Passage: id"),
        ("corpus", json.dumps({"id": "doc0", "title": "t", "text": "x"}), "passage id 'doc0' of record 3"),
        ("qa", json.dumps({"question": "q?"}), "qa.jsonl:3: not a Question: answers"),
        ("qa", json.dumps({"question": "q?", "answers": []}), "qa.jsonl:3: not a Question: answers"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, which: str, line: str, message: str) -> None:
    corpus, questions = users_files(tmp_path)
    target = corpus if which == "corpus" else questions
    lines = target.read_text(encoding="utf-8").splitlines()
    write_lines(target, [*lines[:2], line, *lines[2:]])
    with pytest.raises(CorpusFileError, match=message.replace(".", r"\.")):
        load_dataset(corpus, questions)


def test_too_few_questions_for_every_split(tmp_path: Path) -> None:
    corpus, _ = users_files(tmp_path)
    questions = write_lines(tmp_path / "few.jsonl", [json.dumps({"question": "Who?", "answers": ["me"]})])
    with pytest.raises(CorpusFileError, match="no question falls in split"):
        load_dataset(corpus, questions)
