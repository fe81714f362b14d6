"""SearchQA over HTTP with the default real-facts corpus: an oracle agent, retrieval recall, bad input.

One server for the module, with a cache folder of its own: its start builds the dataset and the
index (``SearchQAEnv.prepare``, cold, timed and printed), a second server start reads both back
(warm). A user's own corpus and questions (``--corpus``, ``--questions``) are served the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import RunningServer, create_instance, free_port, start_server, step_instance, stop_server

from env_server.envs.search.corpus import Passage, Question
from env_server.envs.search.facts import Dataset, default_dataset
from env_server.envs.search.searchqa import CORRECT, EMPTY_QUERY, INVALID, WRONG_END

ENV = "search/searchqa"
ENV_PATH = "env_server.envs.search.searchqa:SearchQAEnv"
STARGYM = [sys.executable, "-m", "deploy"]
TIMEOUT = httpx.Timeout(60.0)  # the first create loads the data: ~5 s cold on 2 cores
ORACLE_SAMPLE = 20
MIN_RECALL_AT_5 = 0.9


@dataclass
class Served:
    server: RunningServer
    cache_dir: Path
    start_s: float


def serve(tmp_path: Path, cache_dir: Path, *extra: str) -> RunningServer:
    port = free_port()
    return start_server(
        ["env", "serve", "--env", ENV_PATH, "--port", str(port), *extra],
        port,
        tmp_path,
        env={"STARGYM_CACHE_DIR": str(cache_dir)},
        name="search",
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache_dir = tmp_path_factory.mktemp("stargym-cache")
    started = time.perf_counter()
    server = serve(tmp_path_factory.mktemp("search"), cache_dir)
    start_s = time.perf_counter() - started
    print(f"\nsearchqa: server start with the dataset and index built (cold cache) {start_s:.1f} s")
    try:
        yield Served(server, cache_dir, start_s)
    finally:
        stop_server(server.process)


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.server.url, timeout=TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def dataset(served: Served) -> Dataset:
    return default_dataset(served.cache_dir)  # what the server wrote


def create(client: httpx.Client, seed: int, options: dict | None = None) -> dict:
    return create_instance(client, ENV, seed, options)


step = step_instance


def oracle_queries(passage: Passage) -> list[str]:
    """How the oracle looks a passage up: its title and kind ("Tbilisi city"), else its whole text.

    The title alone is ambiguous where names repeat (the country Georgia, the U.S. state); title
    and kind found 7,595 of the 7,599 multi-hop chains' every passage in the top 5, the text the rest.
    """
    return [f"{passage.title} {passage.id.split(':', 1)[0]}", passage.text]


def test_an_oracle_agent_answers_multi_hop_questions(client: httpx.Client, dataset: Dataset) -> None:
    by_id = {passage.id: passage for passage in dataset.passages}
    sample = [(i, q) for i, q in enumerate(dataset.questions["test"]) if q.hops >= 2][:ORACLE_SAMPLE]
    assert len(sample) == ORACLE_SAMPLE and {q.hops for _, q in sample} >= {2, 3}
    for index, question in sample:
        created = create(client, 0, {"split": "test", "index": index, "top_k": 5})
        assert created["observation"] == f"Question: {question.question}"
        instance_id = created["instance_id"]
        for hop in question.evidence:
            for query in oracle_queries(by_id[hop]):
                found = step(client, instance_id, f"<think>Look up {hop}.</think><search>{query}</search>")
                if hop in found["info"]["passages"]:
                    break
            else:
                raise AssertionError(f"{question.id}: no search finds {hop}")
        assert any(answer in found["observation"] for answer in question.answers), question
        answered = step(client, instance_id, f"<answer>{question.answers[0]}</answer>")
        assert (answered["observation"], answered["reward"], answered["done"]) == (CORRECT, 1.0, True)
        assert answered["info"]["f1"] == 1.0
        client.delete(f"/instances/{instance_id}")


def test_single_hop_recall_at_5(client: httpx.Client, dataset: Dataset) -> None:
    """The question itself as the query: its evidence passage is among the 5 shown."""
    single = [(i, q) for i, q in enumerate(dataset.questions["test"]) if q.hops == 1]
    instance_id = create(client, 0, {"split": "test", "top_k": 5})["instance_id"]
    started = time.perf_counter()
    hits = sum(
        question.evidence[0]
        in step(client, instance_id, f"<search>{question.question}</search>")["info"]["passages"]
        for _, question in single
    )
    elapsed = time.perf_counter() - started
    recall = hits / len(single)
    print(
        f"\nsearchqa: single-hop recall@5 {recall:.3f} over {len(single)} test questions "
        f"({len(single) / elapsed:.0f} searches/s over HTTP, one client)"
    )
    assert recall >= MIN_RECALL_AT_5


def test_same_seed_same_question_and_passages(client: httpx.Client) -> None:
    runs = []
    for _ in range(2):
        created = create(client, 12345, {"split": "dev"})
        searched = step(client, created["instance_id"], "<search>capital of Georgia</search>")
        runs.append((created["observation"], created["info"], searched))
        client.delete(f"/instances/{created['instance_id']}")
    assert runs[0] == runs[1]
    assert len(runs[0][2]["info"]["passages"]) == 3  # AgentGym's top 3 by default


def test_agentgym_searchqa_client_sequence(client: httpx.Client, dataset: Dataset) -> None:
    """Exactly what AgentGym's ``SearchQAEnvClient`` sends (its env_idx dialect): ``/create
    {"id": 0}`` keeping the bare answer as ``env_idx``, ``/reset {"id": data_idx, "env_idx"}``
    answered with the bare observation, ``/step`` read as ``{observation, reward, done}``."""
    base = "/agentgym/searchqa"
    created = client.post(f"{base}/create", json={"id": 0})
    assert created.status_code == 200, created.text
    env_idx = created.json()
    assert isinstance(env_idx, str) and env_idx
    reset = client.post(f"{base}/reset", json={"id": 1, "env_idx": env_idx})
    first: Question = dataset.questions["test"][1]  # AgentGym numbers test questions first
    assert reset.status_code == 200 and reset.json() == f"Question: {first.question}"
    observed = client.get(f"{base}/observation", params={"env_idx": env_idx})
    assert observed.json() == f"Question: {first.question}"
    searched = client.post(
        f"{base}/step", json={"action": f"<search>{first.question}</search>", "env_idx": env_idx}
    ).json()
    assert searched["observation"].startswith("<information>Doc 1(Title: ")
    assert searched["reward"] == 0.0 and searched["done"] is False
    answered = client.post(
        f"{base}/step", json={"action": f"<answer>{first.answers[0]}</answer>", "env_idx": env_idx}
    ).json()
    assert (answered["observation"], answered["reward"], answered["done"]) == (CORRECT, 1.0, True)
    assert answered["info"]["em"] == 1.0
    train = len(dataset.questions["test"])  # the first train question follows the test questions
    reset = client.post(f"{base}/reset", json={"id": train, "env_idx": env_idx})
    assert reset.json() == f"Question: {dataset.questions['train'][0].question}"
    total = sum(len(questions) for questions in dataset.questions.values())
    past = client.post(f"{base}/reset", json={"id": total, "env_idx": env_idx})
    assert past.status_code == 422 and f"past the {total} questions" in past.text
    assert client.post(f"{base}/close", json={"env_idx": env_idx}).json() is True
    gone = client.post(f"{base}/step", json={"action": "<answer>x</answer>", "env_idx": env_idx})
    assert gone.status_code == 404


@pytest.mark.parametrize(
    "options",
    [
        {"split": "validation"},
        {"top_k": 0},
        {"top_k": "many"},
        {"wrong_answer": "retry"},
        {"index": 10_000_000},  # past the split: known only once the data is loaded
        {"colour": "red"},
    ],
)
def test_bad_options_are_422(client: httpx.Client, options: dict) -> None:
    response = client.post("/instances", json={"env": ENV, "seed": 0, "options": options})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_options"


def test_hostile_replies_are_answered(client: httpx.Client) -> None:
    instance_id = create(client, 3)["instance_id"]
    empty = step(client, instance_id, "<search></search>")
    assert (empty["observation"], empty["info"]["valid"]) == (EMPTY_QUERY, False)
    binary = step(client, instance_id, "<search>\x00\x01\x02\x1b[31m\ufffd</search>")
    assert binary["info"]["valid"] is True  # "31m" is a word
    huge = step(client, instance_id, "<search>" + "capital of Georgia " * 6_000 + "</search>")
    assert huge["info"]["valid"] and huge["info"]["query_truncated"] and len(huge["info"]["passages"]) == 3
    neither = step(client, instance_id, "I think it is Paris.")
    assert (neither["observation"], neither["info"]["valid"]) == (INVALID, False)
    client.delete(f"/instances/{instance_id}")


def test_an_action_after_done_is_409(client: httpx.Client) -> None:
    instance_id = create(client, 5, {"wrong_answer": "end"})["instance_id"]
    ended = step(client, instance_id, "<answer>certainly not this</answer>")
    assert (ended["observation"], ended["reward"], ended["done"]) == (WRONG_END, 0.0, True)
    late = client.post(f"/instances/{instance_id}/step", json={"action": "<search>Tbilisi</search>"})
    assert late.status_code == 409 and late.json()["error"]["code"] == "episode_done"
    client.delete(f"/instances/{instance_id}")


def test_a_second_server_start_reads_the_caches(served: Served, tmp_path: Path) -> None:
    """The dataset and the index are read back, not built again: no cached file is rewritten."""
    cached = {path: path.stat().st_mtime_ns for path in served.cache_dir.rglob("*") if path.is_file()}
    assert any("index" in str(path) for path in cached) and len(cached) >= 3
    started = time.perf_counter()
    server = serve(tmp_path, served.cache_dir)
    warm_s = time.perf_counter() - started
    print(f"\nsearchqa: server start with warm caches {warm_s:.1f} s (cold: {served.start_s:.1f} s)")
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            created = http.post("/instances", json={"env": ENV, "seed": 0})
        assert created.status_code == 201, created.text
    finally:
        stop_server(server.process)
    after = {path: path.stat().st_mtime_ns for path in served.cache_dir.rglob("*") if path.is_file()}
    assert after == cached


def test_a_users_corpus_and_questions(tmp_path: Path) -> None:
    """``--corpus`` and ``--questions``: the README's worked example, served and answered."""
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text(
        '{"id": "d1", "title": "Lake Baikal", "text": "Lake Baikal is the deepest lake in the world, in Siberia."}\n'
        '{"id": "d2", "title": "Crater Lake", "text": "Crater Lake is the deepest lake in the United States."}\n'
    )
    # Split 80/10/10 by a hash of the text: enough questions for every split to get some.
    record = (
        '{{"question": "Which is the deepest lake in the world ({})?", "answers": ["Lake Baikal", "Baikal"]}}'
    )
    questions.write_text("".join(record.format(n) + "\n" for n in range(40)))
    server = serve(
        tmp_path / "logs", tmp_path / "cache", "--corpus", str(corpus), "--questions", str(questions)
    )
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            instance = http.post("/instances", json={"env": ENV, "seed": 0, "options": {"split": "train"}})
            assert instance.status_code == 201, instance.text
            assert instance.json()["observation"].startswith(
                "Question: Which is the deepest lake in the world"
            )
            url = f"/instances/{instance.json()['instance_id']}/step"
            searched = http.post(url, json={"action": "<search>deepest lake world</search>"}).json()
            assert searched["observation"].startswith('<information>Doc 1(Title: "Lake Baikal")')
            answered = http.post(url, json={"action": "<answer>baikal</answer>"}).json()
            assert answered["reward"] == 1.0 and answered["done"]
    finally:
        stop_server(server.process)


def test_a_bad_corpus_file_stops_the_server_with_its_line(tmp_path: Path) -> None:
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text('{"id": "d1", "title": "A", "text": "a"}\n{"id": "d2", "title": "B"}\n')
    questions.write_text('{"question": "q?", "answers": ["a"]}\n')
    command = [*STARGYM, "env", "serve", "--env", ENV_PATH, "--port", str(free_port())]
    done = subprocess.run(
        [*command, "--corpus", str(corpus), "--questions", str(questions)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "STARGYM_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode == 2
    assert f"cannot serve {ENV}: {corpus}:2: not a Passage: text: Field required" in done.stderr
