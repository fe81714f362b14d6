"""SearchQA's env object on a small corpus: rendering, grading, reply parsing, options, data settings."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from env_server.core import EnvFailure
from env_server.envs.search import searchqa
from env_server.envs.search.corpus import Passage, Question, write_jsonl
from env_server.envs.search.facts import DEFAULT_SPLITS, Dataset
from env_server.envs.search.retriever import MAX_QUERY_TERMS
from env_server.envs.search.searchqa import (
    CORRECT,
    EMPTY_QUERY,
    INVALID,
    NO_MATCH,
    WRONG_CONTINUE,
    WRONG_END,
    SearchData,
    SearchQAEnv,
    SearchQAOptions,
    SearchSettings,
    exact_match,
    f1_score,
    first_tag,
    last_answer,
    normalise,
    render,
)
from services.errors import ApiError

PASSAGES = [
    Passage(id="country:GE", title="Georgia", text="Georgia is a country in Asia. Its capital is Tbilisi."),
    Passage(id="city:tbilisi", title="Tbilisi", text="Tbilisi is the capital of Georgia."),
    Passage(id="currency:GEL", title="Georgian lari", text="The Georgian lari is the currency of Georgia."),
    Passage(id="country:FR", title="France", text="France is a country in Europe. Its capital is Paris."),
    Passage(id="city:paris", title="Paris", text="Paris is the capital of France."),
    Passage(id="currency:EUR", title="Euro", text="The Euro is the currency of France and others."),
]


def question(n: int, split: str) -> Question:
    country, city, currency = ("GE", "Tbilisi", "Georgian lari") if n % 2 else ("FR", "Paris", "Euro")
    return Question(
        question=f"({split} {n}) What is the currency of the country whose capital is {city}?",
        answers=[currency],
        id=f"{split}-{n}",
        hops=2,
        evidence=[f"city:{city.lower()}", f"country:{country}"],
    )


SIZES = {"train": 8, "dev": 3, "test": 5}
QUESTIONS = {split: [question(n, split) for n in range(SIZES[split])] for split in DEFAULT_SPLITS}


@pytest.fixture(scope="module")
def data() -> SearchData:
    return SearchData.build(Dataset(PASSAGES, QUESTIONS), None)


@pytest.fixture
def env(data: SearchData) -> SearchQAEnv:
    env = SearchQAEnv(data)
    env.reset(1, SearchQAOptions())
    return env


def test_metadata_matches_agentgym_rl() -> None:
    assert SearchQAEnv.env_id() == "search/searchqa"
    assert SearchQAEnv.default_max_turns == 10
    assert SearchQAEnv.instruction.startswith("You must reason inside <think>...</think> first.")


def test_render_is_agentgyms_format() -> None:
    assert render(PASSAGES[:2]) == (
        '<information>Doc 1(Title: "Georgia") Georgia is a country in Asia. Its capital is Tbilisi.\n'
        'Doc 2(Title: "Tbilisi") Tbilisi is the capital of Georgia.</information>'
    )


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("The Georgian Lari!", "georgian lari"),
        ("  an   apple, a pear  ", "apple pear"),
        ("Nay Pyi Taw.", "nay pyi taw"),
        ("U.S.", "us"),
        ("theatre", "theatre"),  # articles are whole words
    ],
)
def test_normalise_is_squads(text: str, normal: str) -> None:
    assert normalise(text) == normal


def test_exact_match_and_f1() -> None:
    assert exact_match("the euro.", ["Euro"]) and exact_match("EUR", ["Euro", "eur"])
    assert not exact_match("euro zone", ["Euro"])
    assert f1_score("euro zone", ["Euro"]) == pytest.approx(2 / 3)
    assert f1_score("Georgian lari", ["lari", "Georgian lari"]) == 1.0  # best over the answers
    assert f1_score("", ["Euro"]) == 0.0 and f1_score("dollar", ["Euro"]) == 0.0


def test_first_observation_is_the_question(data: SearchData) -> None:
    observed = SearchQAEnv(data).reset(3, SearchQAOptions(split="test"))
    assert observed.observation == f"Question: {QUESTIONS['test'][3].question}"
    assert observed.info == {"split": "test", "index": 3, "question_id": "test-3", "hops": 2}


def test_the_seed_picks_the_question_deterministically(data: SearchData) -> None:
    texts = [SearchQAEnv(data).reset(seed, SearchQAOptions()).observation for seed in range(16)]
    assert texts[:8] == [f"Question: {q.question}" for q in QUESTIONS["train"]]
    assert texts[8:] == texts[:8]  # seed % 8 train questions
    chosen = SearchQAEnv(data).reset(5, SearchQAOptions(split="dev", index=2))
    assert chosen.info["index"] == 2


def test_same_seed_same_passages(data: SearchData) -> None:
    runs = []
    for _ in range(2):
        env = SearchQAEnv(SearchData.build(Dataset(PASSAGES, QUESTIONS), None))  # an index of its own
        env.reset(4, SearchQAOptions(top_k=4))
        runs.append([env.step(f"<search>{q}</search>") for q in ("capital Tbilisi", "currency", "Europe")])
    assert [(s.observation, s.info) for s in runs[0]] == [(s.observation, s.info) for s in runs[1]]


def test_search_shows_top_k_passages(env: SearchQAEnv) -> None:
    step = env.step("<think>I need the capital.</think>\n<search> capital Tbilisi </search>")
    assert (step.reward, step.done) == (0.0, False)
    assert step.info == {
        "valid": True,
        "passages": ["city:tbilisi", "country:GE", "city:paris"],
        "query_truncated": False,
    }
    assert step.observation.startswith('<information>Doc 1(Title: "Tbilisi") ')
    assert step.observation.count("\nDoc ") == 2


def test_right_answer_ends_with_reward_one(env: SearchQAEnv) -> None:
    step = env.step("<think>Georgia uses the lari.</think><answer> the georgian LARI </answer>")
    assert (step.observation, step.reward, step.done) == (CORRECT, 1.0, True)
    assert step.info == {
        "valid": True,
        "success": True,
        "em": 1.0,
        "f1": 1.0,
        "answers": ["Georgian lari"],
    }


def test_wrong_answer_continues_by_default(env: SearchQAEnv) -> None:
    step = env.step("<answer>lari coins</answer>")
    assert (step.observation, step.reward, step.done) == (WRONG_CONTINUE, 0.0, False)
    assert step.info == {"valid": True, "success": False, "em": 0.0, "f1": 0.5}
    assert env.step("<answer>Georgian lari</answer>").reward == 1.0


def test_wrong_answer_ends_when_asked(data: SearchData) -> None:
    env = SearchQAEnv(data)
    env.reset(1, SearchQAOptions(wrong_answer="end"))
    step = env.step("<answer>Euro</answer>")
    assert (step.observation, step.reward, step.done) == (WRONG_END, 0.0, True)
    assert step.info["answers"] == ["Georgian lari"]


def test_first_tag_decides_and_last_answer_is_graded(env: SearchQAEnv) -> None:
    assert (
        env.step("<search>Paris</search> <answer>Georgian lari</answer>").info["passages"][0] == "city:paris"
    )
    assert env.step("<answer>Euro</answer> then <answer>Georgian lari</answer>").reward == 1.0
    multiline = env.step("<search>\ncapital\nof Georgia\n</search>")
    assert multiline.info["valid"] and multiline.info["passages"]


def test_tags_are_found_as_agentgyms_regexes_find_them() -> None:
    """Every reply of up to 5 pieces from an alphabet of tags and text, against AgentGym's regexes."""
    agentgym_tag = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
    agentgym_answer = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    pieces = ["<search>", "</search>", "<answer>", "</answer>", "x", "\n"]
    for length in range(6):
        for parts in itertools.product(pieces, repeat=length):
            reply = "".join(parts)
            found = agentgym_tag.search(reply)
            assert first_tag(reply) == (None if found is None else (found[1], found[2])), reply
            answers = agentgym_answer.findall(reply)
            assert last_answer(reply) == (answers[-1] if answers else ""), reply


def test_unclosed_tags_cost_linear_time(env: SearchQAEnv) -> None:
    started = time.perf_counter()
    for reply in ("<search>" * 120_000, "<answer>" * 120_000, "<answer>x</answer>" + "<answer>" * 50_000):
        env.step(reply)
    assert time.perf_counter() - started < 1.0  # AgentGym's regex: 12.5 s for 16,000 "<search>"


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "The answer is the Georgian lari.",
        "<search>capital of Georgia",
        "capital of Georgia</search>",
        "<SEARCH>Tbilisi</SEARCH>",  # AgentGym's tags are lower case
        "<search>Tbilisi</answer>",
        "<answer>lari",
        "<think>only thinking</think>",
        "<information>Doc 1(Title: x) y</information>",
        "\x00\x01<\x7fsearch>",
    ],
)
def test_a_reply_without_either_tag_says_what_is_expected(env: SearchQAEnv, reply: str) -> None:
    step = env.step(reply)
    assert (step.observation, step.reward, step.done, step.info) == (INVALID, 0.0, False, {"valid": False})


@pytest.mark.parametrize("query", ["", "   ", "?!*:()", "\x00\x01\x02\ufffd"])
def test_a_search_without_words_says_so(env: SearchQAEnv, query: str) -> None:
    step = env.step(f"<search>{query}</search>")
    assert (step.observation, step.reward, step.done, step.info) == (
        EMPTY_QUERY,
        0.0,
        False,
        {"valid": False},
    )


def test_a_search_that_matches_nothing(env: SearchQAEnv) -> None:
    step = env.step("<search>zzyzx qwerty</search>")
    assert (step.observation, step.info) == (
        NO_MATCH,
        {"valid": True, "passages": [], "query_truncated": False},
    )


def test_a_100kb_query_is_truncated_and_answered(env: SearchQAEnv) -> None:
    query = "Paris capital " + "filler words " * 8_000
    step = env.step(f"<search>{query}</search>")
    assert len(query) > 100_000
    assert step.info["valid"] and step.info["query_truncated"] and step.info["passages"][0] == "city:paris"
    exact = " ".join(["Paris"] * MAX_QUERY_TERMS)
    assert env.step(f"<search>{exact}</search>").info["query_truncated"] is False


@pytest.mark.parametrize(
    "options",
    [
        {"split": "validation"},
        {"top_k": 0},
        {"top_k": 21},
        {"wrong_answer": "retry"},
        {"index": -1},
        {"index": "first"},
        {"seed": 3},  # unknown keys are an error, not dropped
    ],
)
def test_malformed_options_are_refused(options: dict) -> None:
    with pytest.raises(ValidationError):
        SearchQAOptions.model_validate(options)


def test_an_index_past_the_split_is_422(data: SearchData) -> None:
    with pytest.raises(ApiError) as raised:
        SearchQAEnv(data).reset(0, SearchQAOptions(split="dev", index=3))
    assert raised.value.status == 422 and "3 dev questions" in str(raised.value)


def test_agentgym_data_idx_counts_test_then_train_then_dev(
    data: SearchData, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(searchqa.SHARED, "_value", data)
    assert SearchQAEnv.agentgym_task(0) == (0, {"split": "test", "index": 0})
    assert SearchQAEnv.agentgym_task(4) == (4, {"split": "test", "index": 4})
    assert SearchQAEnv.agentgym_task(5) == (5, {"split": "train", "index": 0})
    assert SearchQAEnv.agentgym_task(13) == (13, {"split": "dev", "index": 0})
    assert SearchQAEnv.agentgym_task(15) == (15, {"split": "dev", "index": 2})
    with pytest.raises(ApiError, match="past the 16 questions"):
        SearchQAEnv.agentgym_task(16)


def test_settings_take_both_files_or_neither(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    write_jsonl(corpus, PASSAGES)
    write_jsonl(questions, QUESTIONS["train"])
    assert SearchSettings() == SearchSettings(corpus=None, questions=None)
    with pytest.raises(ValidationError, match="corpus is set but questions is not"):
        SearchSettings(corpus=corpus)
    monkeypatch.setenv("STARGYM_SEARCH_QUESTIONS", str(questions))
    with pytest.raises(ValidationError, match="questions is set but corpus is not"):
        SearchSettings()
    monkeypatch.setenv("STARGYM_SEARCH_CORPUS", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValidationError, match="corpus"):
        SearchSettings()
    monkeypatch.setenv("STARGYM_SEARCH_CORPUS", str(corpus))
    assert SearchSettings() == SearchSettings(corpus=corpus, questions=questions)


def test_shared_data_loads_the_users_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    write_jsonl(corpus, PASSAGES)
    asked = [Question(question=f"Which city is number {n}?", answers=["Paris"]) for n in range(60)]
    write_jsonl(questions, asked)
    monkeypatch.setenv("STARGYM_SEARCH_CORPUS", str(corpus))
    monkeypatch.setenv("STARGYM_SEARCH_QUESTIONS", str(questions))
    monkeypatch.setenv("STARGYM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(searchqa.SHARED, "_value", None)
    loaded = searchqa.shared_data()
    assert searchqa.shared_data() is loaded
    assert sorted(q.question for split in loaded.questions.values() for q in split) == sorted(
        q.question for q in asked
    )
    assert loaded.retriever.passages == PASSAGES
    assert (tmp_path / "cache" / "search" / "index" / loaded.retriever.folder_name()).is_dir()
    env = SearchQAEnv()
    env.reset(0, SearchQAOptions())
    assert env.step("<answer>paris</answer>").reward == 1.0


def test_an_unreadable_corpus_is_an_env_failure_naming_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text('{"id": "a", "title": "A", "text": "x"}\n{"id": "b", "title": "B"}\n')
    write_jsonl(questions, QUESTIONS["train"])
    monkeypatch.setenv("STARGYM_SEARCH_CORPUS", str(corpus))
    monkeypatch.setenv("STARGYM_SEARCH_QUESTIONS", str(questions))
    monkeypatch.setattr(searchqa.SHARED, "_value", None)
    with pytest.raises(EnvFailure, match=r"corpus\.jsonl:2: not a Passage: text"):
        SearchQAEnv().reset(0, SearchQAOptions())


def test_bad_settings_are_an_env_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGYM_SEARCH_CORPUS", str(tmp_path / "missing.jsonl"))
    monkeypatch.setattr(searchqa.SHARED, "_value", None)
    with pytest.raises(EnvFailure, match=r"search settings: corpus: Path does not point to a file"):
        SearchQAEnv().reset(0, SearchQAOptions())
