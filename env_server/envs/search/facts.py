"""The search family's datasets: the default one generated offline from real facts, or a user's files.

**Default** (:func:`default_dataset`): countries, cities, regions, U.S. states, continents,
currencies, languages and chemical elements from PyPI packages that ship their data
(:mod:`.facts_world`), rendered as ~40,000 Wikipedia-like passages (:mod:`.facts_render`), with
single-hop and 2-4-hop questions whose evidence chains are in the corpus
(:mod:`.facts_questions`). Building takes 1.9 s (0.7 s reading the packages' data, 0.2 s
rendering, 0.8 s questions), so the result is written once as JSONL (7.8 MB) under the cache
directory, in a folder named by a digest of :data:`GENERATOR_VERSION` and the source packages'
versions; a later call (another server process too) reads it back in 0.4 s.

**A user's files** (:func:`load_dataset`): a corpus of ``{id, title, text}`` lines and questions
of ``{question, answers}`` lines, e.g. exported from Natural Questions or HotpotQA.

Questions are split into train/dev/test 80/10/10 by a SHA-256 (:func:`split_of`): disjoint, and
the same in every process and on every machine. A user's questions by their text; generated ones
by the entity they start from (their first evidence passage), so every question about Kutaisi is
in the same split and a test question never starts from an entity a training question starts from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from env_server.envs.search.corpus import CorpusFileError, Passage, Question, read_jsonl, write_jsonl
from env_server.envs.search.facts_questions import make_questions, stable_hash
from env_server.envs.search.facts_render import render
from env_server.envs.search.facts_world import load_world, source_versions

DEFAULT_SPLITS = ("train", "dev", "test")
SPLIT_PERCENT = (80, 10, 10)  # train, dev, test
# Bump when rendering or question generation changes: it renames the cache folder.
GENERATOR_VERSION = "1"


@dataclass(frozen=True)
class Dataset:
    """Passages to search and questions per split (``DEFAULT_SPLITS``; disjoint)."""

    passages: list[Passage]
    questions: dict[str, list[Question]]


def split_of(key: str) -> str:
    """The split of a question whose key (its text; a generated one's first passage) is ``key``."""
    bucket = stable_hash(key) % 100
    if bucket < SPLIT_PERCENT[0]:
        return DEFAULT_SPLITS[0]
    return DEFAULT_SPLITS[1] if bucket < SPLIT_PERCENT[0] + SPLIT_PERCENT[1] else DEFAULT_SPLITS[2]


def split(questions: list[Question], by_entity: bool = False) -> dict[str, list[Question]]:
    """``questions`` by :func:`split_of` of their text, or of their first evidence passage when
    ``by_entity``; each split in the given order."""
    splits: dict[str, list[Question]] = {name: [] for name in DEFAULT_SPLITS}
    for question in questions:
        splits[split_of(question.evidence[0] if by_entity else question.question)].append(question)
    return splits


def build_dataset() -> Dataset:
    """Generate the default dataset from the installed source packages (no cache involved)."""
    world = load_world()
    passages = render(world)
    return Dataset(passages, split(make_questions(world, passages), by_entity=True))


def cache_root() -> Path:
    """``$STARGYM_CACHE_DIR``, else ``~/.cache/stargym``."""
    configured = os.environ.get("STARGYM_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "stargym"


def dataset_key() -> str:
    """What the default dataset is a function of: this generator and the source packages."""
    versions = json.dumps({"generator": GENERATOR_VERSION, **source_versions()}, sort_keys=True)
    return hashlib.sha256(versions.encode()).hexdigest()[:16]


def default_dataset(cache_dir: Path | None = None) -> Dataset:
    """The default dataset, read from the cache, or built and cached when not there yet.

    The cache is written into a temporary folder renamed into place, so concurrent first starts
    never see half a dataset: one rename wins and the others' copies are dropped.
    """
    folder = (cache_dir or cache_root()) / "search" / f"facts-{dataset_key()}"
    if folder.is_dir():
        return _read(folder)
    dataset = build_dataset()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write_jsonl(staging / "passages.jsonl", dataset.passages)
        for name, questions in dataset.questions.items():
            write_jsonl(staging / f"{name}.jsonl", questions)
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():  # not a lost race: a real write error
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dataset


def _read(folder: Path) -> Dataset:
    passages = read_jsonl(folder / "passages.jsonl", Passage)
    questions = {name: read_jsonl(folder / f"{name}.jsonl", Question) for name in DEFAULT_SPLITS}
    return Dataset(passages, questions)


def load_dataset(corpus: Path, questions: Path) -> Dataset:
    """A user's corpus (``{id, title, text}`` lines) and questions (``{question, answers}`` lines).

    Extra fields are ignored; a malformed line raises :class:`~.corpus.CorpusFileError` naming the
    file and line, and so do duplicate passage ids (the retriever returns passages by id) and a
    split left empty (fewer than a handful of questions).
    """
    passages = read_jsonl(corpus, Passage)
    seen: dict[str, int] = {}
    for number, passage in enumerate(passages, start=1):
        if passage.id in seen:
            raise CorpusFileError(
                f"{corpus}: passage id {passage.id!r} of record {number} repeats record {seen[passage.id]}"
            )
        seen[passage.id] = number
    splits = split(read_jsonl(questions, Question))
    empty = [name for name, members in splits.items() if not members]
    if empty:
        raise CorpusFileError(
            f"{questions}: no question falls in split(s) {', '.join(empty)} (questions are split 80/10/10"
            " by a hash of their text; bring at least ~30)"
        )
    return Dataset(passages, splits)
