"""Passages and questions of the search family, and the JSONL files a user brings instead of ours.

A corpus is passages ``{id, title, text}``; a question set is ``{question, answers}`` records (the
shape NQ and HotpotQA exports reduce to). Fields beyond those are ignored, so such exports load as
they are; a missing or mistyped field is an error naming the file and line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.errors import validation_problems

M = TypeVar("M", bound=BaseModel)


class Passage(BaseModel):
    """One retrievable passage."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str = Field(min_length=1)
    title: str
    text: str


class Question(BaseModel):
    """One question with its accepted answers.

    ``evidence``: ids of the passages that hold the answer chain, in hop order (known for the
    generated questions, empty for a user's); ``hops`` is their number (0 when unknown).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    question: str = Field(min_length=1)
    answers: list[str] = Field(min_length=1)
    id: str = ""
    hops: int = Field(default=0, ge=0)
    evidence: list[str] = Field(default_factory=list)

    @field_validator("answers")
    @classmethod
    def non_empty_answers(cls, answers: list[str]) -> list[str]:
        if not all(answer.strip() for answer in answers):
            raise ValueError("answers must be non-empty strings")
        return answers


class CorpusFileError(ValueError):
    """A corpus or question file that cannot be read; the message names the file and line."""


def read_jsonl(path: Path, model: type[M]) -> list[M]:
    """Every line of ``path`` as a ``model``; blank lines are skipped."""
    records: list[M] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusFileError(f"cannot read {str(path)!r}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(model.model_validate_json(line))
        except ValidationError as exc:
            problem = validation_problems(exc, "line", limit=3)
            raise CorpusFileError(f"{path}:{number}: not a {model.__name__}: {problem}") from None
    if not records:
        raise CorpusFileError(f"{str(path)!r} holds no records")
    return records


def write_jsonl(path: Path, records: Iterable[BaseModel]) -> None:
    """Write ``records`` one JSON object per line (what :func:`read_jsonl` reads back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(record.model_dump_json(exclude_defaults=True) + "\n")


def corpus_hash(passages: Iterable[Passage]) -> str:
    """A digest of the passages' ids, titles and texts, in order: the key of a cached index."""
    digest = hashlib.sha256()
    for passage in passages:
        for part in (passage.id, passage.title, passage.text):
            digest.update(part.encode("utf-8"))
            digest.update(b"\0")
    return digest.hexdigest()
