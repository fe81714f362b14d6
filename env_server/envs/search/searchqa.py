"""SearchQA: answer a (multi-hop) question by searching a corpus, in AgentGym-RL's format.

The agent replies ``<search>query</search>`` and sees the top-k passages the way AgentGym's
SearchQA server renders them, ``<information>Doc 1(Title: "…") …\\nDoc 2(Title: "…") …</information>``
(the quotes: its wiki-18 corpus's contents start with the quoted title, which it prints as is),
or ``<answer>text</answer>``, which scores 1 on an exact match with an accepted answer after
SQuAD's normalisation. As in AgentGym the first of either tag in a reply decides what it is, and
the answer graded is the reply's last ``<answer>`` block; its other texts are AgentGym's too.

**Data.** By default the real-facts corpus and questions of :mod:`.facts`; a user's JSONL files
when ``STARGYM_SEARCH_CORPUS`` and ``STARGYM_SEARCH_QUESTIONS`` are both set (:class:`SearchSettings`).
Both, and the retriever's index, are loaded once per process, by the first reset, and shared by
every instance: the first create takes ~0.6 s with the caches warm, ~5 s cold (2-core dev machine).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from env_server.core import Env, Observation, Step
from env_server.envs.search import facts
from env_server.envs.search.corpus import CorpusFileError, Passage, Question
from env_server.envs.search.retriever import MAX_QUERY_TERMS, Retriever, query_terms, shared_retriever
from env_server.shared import ProcessShared
from services.errors import ApiError

# AgentGym's server numbers its test questions first, then its train questions; dev comes last.
AGENTGYM_ORDER = ("test", "train", "dev")
DEFAULT_TOP_K = 3  # AgentGym's server: retrieval_topk 3
MAX_TOP_K = 20
OPENING = re.compile(r"<(search|answer)>")
ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = str.maketrans("", "", string.punctuation)

# AgentGym's texts, word for word: policies trained on its server read these.
INSTRUCTION = (
    "You must reason inside <think>...</think> first. If you do not have enough knowledge, issue a "
    "<search>...</search> and then STOP. Do not generate <information> or <answer> yet. Wait for "
    "external input wrapped in <information>...</information>. After receiving information, reason "
    "again in <think>. If confident, output your final answer in <answer>...</answer>. Do not output "
    "<answer> before receiving <information> unless you are fully confident. If you find no further "
    "external knowledge needed, you can directly provide the answer inside <answer> and </answer>, "
    "without detailed illustrations. For example, <answer> Beijing </answer>. Follow this process "
    "every time."
)
INVALID = (
    "Your previous action is invalid. If you want to search, you should put the query between "
    "<search> and </search>. If you want to give the final answer, you should put the answer between "
    "<answer> and </answer>. Please try again."
)
CORRECT = "Congratulations! You have answered the question correctly."
WRONG_CONTINUE = "Sorry, your answer is incorrect. Please try again."
WRONG_END = "Sorry, your answer is incorrect."
# Ours: AgentGym's dense retriever returns passages for any query, BM25 none for one without words.
EMPTY_QUERY = (
    "Your search query has no words to search for. Put search terms between <search> and </search>, "
    "e.g. <search>capital of Georgia</search>."
)
NO_MATCH = "<information>No passage matches the query.</information>"


class SearchSettings(BaseSettings):
    """Which data the env serves: a user's corpus and questions (both), or the default (neither)."""

    model_config = SettingsConfigDict(env_prefix="STARGYM_SEARCH_", extra="ignore", env_ignore_empty=True)

    corpus: FilePath | None = Field(default=None, description="JSONL of {id, title, text} passages.")
    questions: FilePath | None = Field(default=None, description="JSONL of {question, answers} records.")

    @model_validator(mode="after")
    def both_or_neither(self) -> SearchSettings:
        if (self.corpus is None) != (self.questions is None):
            given, missing = ("corpus", "questions") if self.questions is None else ("questions", "corpus")
            raise ValueError(
                f"{given} is set but {missing} is not: give both a corpus and questions "
                "(STARGYM_SEARCH_CORPUS, STARGYM_SEARCH_QUESTIONS), or neither for the default facts"
            )
        return self


@dataclass(frozen=True)
class SearchData:
    """What every instance of a process shares: the questions per split and the retriever."""

    questions: dict[str, list[Question]]
    retriever: Retriever

    @classmethod
    def build(cls, dataset: facts.Dataset, cache_dir: Path | None) -> SearchData:
        return cls(dataset.questions, shared_retriever(dataset.passages, cache_dir))


def load_data() -> SearchData:
    """The data :class:`SearchSettings` say to serve, and its retriever (see :func:`shared_data`)."""
    settings = SearchSettings()
    if settings.corpus is not None and settings.questions is not None:
        dataset = facts.load_dataset(settings.corpus, settings.questions)
    else:
        dataset = facts.default_dataset()
    return SearchData.build(dataset, facts.cache_root())


SHARED = ProcessShared("search", load_data, (CorpusFileError,))


def shared_data() -> SearchData:
    """The process's data, loaded by the first caller as :class:`SearchSettings` say. Bad settings, or
    a corpus or question file that cannot be read, are an :class:`EnvFailure` (the host answers 502
    with its message, which names the setting, or the file and line)."""
    return SHARED.get()


class SearchQAOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    split: Literal["train", "dev", "test"] = Field(default="train", description="Which questions.")
    index: int | None = Field(
        default=None, ge=0, description="The question's position in the split; none: the seed picks it."
    )
    top_k: int = Field(
        default=DEFAULT_TOP_K, ge=1, le=MAX_TOP_K, description="Passages per search (AgentGym's: 3)."
    )
    wrong_answer: Literal["continue", "end"] = Field(
        default="continue",
        description="After a wrong answer: go on (AgentGym's server) or end the episode (Search-R1).",
    )


class SearchQAEnv(Env):
    """One question to answer with searches.

    The seed picks the question, ``seed % size of the split``, unless ``index`` is given. The
    first observation is the question; the instruction says how to search and answer.

    A reply with neither tag, or a search without words (empty, punctuation, control or binary
    characters), is an observation saying what is expected, with ``info["valid"]`` False. A
    search of more than ``MAX_QUERY_TERMS`` words uses the first ones and says so in
    ``info["query_truncated"]``. ``info["passages"]`` lists the ids of the passages shown. An
    answer's info has its exact match ``em`` (the reward) and SQuAD ``f1``.
    """

    name = "searchqa"
    family = "search"
    instruction = INSTRUCTION
    action_format = "<search>query</search> to search, or <answer>text</answer> to answer"
    default_max_turns = 10  # AgentGym-RL's longest SearchQA horizon (5/8/10)
    reward_range = (0.0, 1.0)
    Options = SearchQAOptions
    agentgym_dialect = "env_idx"  # AgentGym's SearchQA client: /create {"id": 0}, then env_idx
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py
    vocabulary_actions = ("<search>", "</search>", "<answer>", "</answer>")

    @classmethod
    def prepare(cls) -> None:
        """Load the questions and open (or build) the index before the server listens."""
        shared_data()

    def __init__(self, data: SearchData | None = None) -> None:
        """``data``: what to serve; by default the process's shared data (:func:`shared_data`)."""
        self._data = data
        self._question: Question | None = None
        self._options = SearchQAOptions()

    @classmethod
    def agentgym_task(cls, data_idx: int) -> tuple[int, dict[str, Any] | None]:
        """AgentGym's data_idx: the test questions, then train's, then dev's (AgentGym has none)."""
        questions = shared_data().questions
        index = data_idx
        for split in AGENTGYM_ORDER:
            if index < len(questions[split]):
                return data_idx, {"split": split, "index": index}
            index -= len(questions[split])
        total = sum(len(questions[split]) for split in AGENTGYM_ORDER)
        raise ApiError(
            422, "invalid_options", f"data_idx {data_idx} is past the {total} questions (0-{total - 1})"
        )

    def reset(self, seed: int, options: SearchQAOptions) -> Observation:
        if self._data is None:
            self._data = shared_data()
        questions = self._data.questions[options.split]
        if options.index is not None and options.index >= len(questions):
            raise ApiError(
                422,
                "invalid_options",
                f"index {options.index} is past the {len(questions)} {options.split} questions",
            )
        index = seed % len(questions) if options.index is None else options.index
        self._question = questions[index]
        self._options = options
        info = {
            "split": options.split,
            "index": index,
            "question_id": self._question.id,
            "hops": self._question.hops,
        }
        return Observation(f"Question: {self._question.question}", info)

    def step(self, action: str) -> Step:
        if self._question is None or self._data is None:
            raise RuntimeError("reset the env before stepping it")
        tagged = first_tag(action)
        if tagged is None:
            return Step(INVALID, 0.0, False, {"valid": False})
        kind, content = tagged
        if kind == "search":
            return self._search(content.strip())
        return self._answer(last_answer(action).strip())

    def _search(self, query: str) -> Step:
        assert self._data is not None
        terms = query_terms(query)
        if not terms:
            return Step(EMPTY_QUERY, 0.0, False, {"valid": False})
        passages = self._data.retriever.search(query, self._options.top_k)
        info = {
            "valid": True,
            "passages": [passage.id for passage in passages],
            "query_truncated": len(terms) > MAX_QUERY_TERMS,
        }
        return Step(render(passages) if passages else NO_MATCH, 0.0, False, info)

    def _answer(self, answer: str) -> Step:
        assert self._question is not None
        gold = self._question.answers
        em = exact_match(answer, gold)
        info: dict[str, Any] = {"valid": True, "success": em, "em": float(em), "f1": f1_score(answer, gold)}
        if em:
            return Step(CORRECT, 1.0, True, {**info, "answers": gold})
        if self._options.wrong_answer == "end":
            return Step(WRONG_END, 0.0, True, {**info, "answers": gold})
        return Step(WRONG_CONTINUE, 0.0, False, info)


def first_tag(reply: str) -> tuple[str, str] | None:
    """The first ``<search>…</search>`` or ``<answer>…</answer>`` block: its tag and content.

    What AgentGym's ``re.search(r"<(search|answer)>(.*?)</\\1>", reply, re.DOTALL)`` finds, in
    linear time: that regex rescans to the end from every opening tag without its closing one, so
    a 128 KB reply of repeated "<search>" took 12.5 s with it.
    """
    last_close = {kind: reply.rfind(f"</{kind}>") for kind in ("search", "answer")}
    for opening in OPENING.finditer(reply):
        kind = opening[1]
        if last_close[kind] >= opening.end():
            return kind, reply[opening.end() : reply.find(f"</{kind}>", opening.end())]
    return None


def last_answer(reply: str) -> str:
    """The content of the last ``<answer>…</answer>`` block, the one AgentGym's scorer grades."""
    found, start = "", 0
    while (opening := reply.find("<answer>", start)) >= 0:
        closing = reply.find("</answer>", opening + len("<answer>"))
        if closing < 0:
            break
        found, start = reply[opening + len("<answer>") : closing], closing + len("</answer>")
    return found


def render(passages: list[Passage]) -> str:
    """Passages as AgentGym's SearchQA server shows them: numbered from 1, one per line, in tags."""
    docs = "".join(f'Doc {n}(Title: "{p.title}") {p.text}\n' for n, p in enumerate(passages, start=1))
    return f"<information>{docs.strip()}</information>"


def normalise(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(ARTICLES.sub(" ", text.lower().translate(PUNCTUATION)).split())


def exact_match(prediction: str, answers: list[str]) -> bool:
    normalised = normalise(prediction)
    return any(normalised == normalise(answer) for answer in answers)


def f1_score(prediction: str, answers: list[str]) -> float:
    """SQuAD's token F1, the best over the accepted answers."""
    predicted = normalise(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalise(answer).split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
