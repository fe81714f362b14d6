"""``stargym eval`` and the ``openai`` engine against real servers.

The CLI runs as a real subprocess (starting its own CPU engine and game server, or using given
ones); the openai engine plays against our CPU engine's ``/v1/chat/completions``, which is also
checked on its own: OpenAI's response shape, and the same tokens as ``/v1/completions`` on the
templated prompt. Bad input must exit non-zero with one clear line and no traceback.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from conftest import REPO_ROOT, STARGYM, RunningServer, free_port, start_engine, stop_server
from transformers import AutoTokenizer

from deploy.model_init import init_tiny_model
from rollout_server.actions import FORMAT_PENALTY, format_instruction
from rollout_server.openai_chat import OpenAIChatClient, run_chat_episode
from services.engine_client import EngineContextLengthError
from services.env_client import EnvClient
from services.rollout_protocol import RolloutJob, SamplingParams, Trajectory

API_TOKEN = "eval-test-key"
SERVED_NAME = "tiny"
FROZENLAKE, BANDIT = "game/frozenlake", "game/bandit"
CLI_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("eval-model") / "policy-v0", 0, ["game"], 20, 20)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Our CPU engine behind a bearer token, as a hosted OpenAI-compatible API would be."""
    server = start_engine(
        model_dir,
        tmp_path_factory.mktemp("eval-engine"),
        "--served-model-name",
        SERVED_NAME,
        env={"STARGYM_API_TOKEN": API_TOKEN},
    )
    yield server
    stop_server(server.process)


@pytest.fixture
async def envs(game_server: RunningServer) -> AsyncIterator[EnvClient]:
    async with EnvClient(game_server.url, timeout=30.0) as client:
        yield client


@pytest.fixture
async def chat(engine_server: RunningServer) -> AsyncIterator[OpenAIChatClient]:
    # A bare host:port gets /v1, as the OpenAI SDK's base URL has it.
    async with OpenAIChatClient(engine_server.url, SERVED_NAME, API_TOKEN, timeout=60.0) as client:
        yield client


def stargym(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STARGYM, *args],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


def read_trajectories(path: Path) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


# -- the chat route of the CPU engine ----------------------------------------------------------


def test_chat_route_answers_in_openai_shape(engine_server: RunningServer, tokenizer: Any) -> None:
    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    messages = [
        {"role": "system", "content": "You play FrozenLake."},
        {"role": "user", "content": "P _ O _\nReach G and avoid O."},
    ]
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": 6, "temperature": 0.0, "seed": 3}
    answer = httpx.post(f"{engine_server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == SERVED_NAME and isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    # The prompt is the chat template with its generation prompt; the reply is what greedy
    # token-in generation of that same prompt gives.
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert 1 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    completion = httpx.post(
        f"{engine_server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True},
        headers=headers,
        timeout=60,
    ).json()["choices"][0]
    assert choice["message"]["content"] == completion["text"]
    assert usage["completion_tokens"] == len(completion["token_ids"])

    # OpenAI's multi-part content is the same text; max_completion_tokens is max_tokens' new name.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    again = httpx.post(
        f"{engine_server.url}/v1/chat/completions",
        json={"messages": parts, "max_completion_tokens": 6, "temperature": 0.0},
        headers=headers,
        timeout=60,
    ).json()
    assert again["choices"][0]["message"] == choice["message"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 101}},
            422,
            "validation_error",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "metadata": {}}, 422, "validation_error"),
        ({"messages": []}, 422, "validation_error"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, 422, "validation_error"),
        ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4096}, 400, "context_too_long"),
    ],
)
def test_chat_route_refuses_bad_requests(
    engine_server: RunningServer, body: dict[str, Any], status: int, code: str
) -> None:
    answer = httpx.post(
        f"{engine_server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_TOKEN}"},
        timeout=60,
    )
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code


# -- the openai engine -------------------------------------------------------------------------


def make_job(env: str, seed: int, **fields: Any) -> RolloutJob:
    defaults: dict[str, Any] = {
        "run_id": "eval-test",
        "group_id": f"g{seed}",
        "max_turns": 3,
        "policy_version": 0,
        "sampling": SamplingParams(temperature=1.0, max_tokens=8, seed=seed),
    }
    return RolloutJob(env=env, seed=seed, **(defaults | fields))


async def test_openai_engine_plays_text_only_episodes(
    envs: EnvClient, chat: OpenAIChatClient, tokenizer: Any
) -> None:
    instruction = {spec.id: spec.instruction for spec in await envs.list_envs()}[FROZENLAKE]
    before = {instance.instance_id for instance in (await envs.list_instances()).instances}
    template = tokenizer.apply_chat_template
    for action_format in ("answer_tags", "plain"):
        job = make_job(FROZENLAKE, 5, action_format=action_format)
        trajectory = await run_chat_episode(job, envs, chat, instruction)
        assert trajectory.text_only and not trajectory.trainable
        assert "text-only" in (trajectory.untrainable_reason or "")
        assert trajectory.token_ids == trajectory.loss_mask == trajectory.logprobs == []
        assert trajectory.job_id == job.job_id and trajectory.action_format == action_format
        assert 1 <= trajectory.num_turns <= 3
        assert trajectory.reward == pytest.approx(sum(turn.reward for turn in trajectory.turns))
        assert trajectory.truncated == (not trajectory.turns[-1].done)
        assert Trajectory.model_validate_json(trajectory.model_dump_json()) == trajectory
        # The conversation is the documented one: instruction (+ format) and observation as the
        # first user message, each reply an assistant message, each observation a user message.
        first = instruction + (
            "\n\n" + format_instruction("answer_tags") if action_format == "answer_tags" else ""
        )
        messages = [{"role": "user", "content": f"{first}\n\n{trajectory.turns[0].observation}"}]
        for index, turn in enumerate(trajectory.turns):
            if index:
                previous = trajectory.turns[index - 1].response
                messages += [
                    {"role": "assistant", "content": previous},
                    {"role": "user", "content": turn.observation},
                ]
            rendered = template(messages, tokenize=False, add_generation_prompt=True)
            assert turn.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
            assert 1 <= turn.response_tokens <= 8
            if action_format == "answer_tags":
                # A random model does not write <think>…</think><answer>…</answer>.
                assert turn.actions == [] and not turn.valid and turn.reward == FORMAT_PENALTY
            else:
                assert turn.actions == [turn.response.strip()]
    assert {instance.instance_id for instance in (await envs.list_instances()).instances} <= before


async def test_openai_engine_keeps_the_history_window(
    envs: EnvClient, chat: OpenAIChatClient, tokenizer: Any
) -> None:
    """With ``history_turns=1`` a request holds the instruction before the previous observation,
    the previous reply and the current observation: the endpoint's prompt count says so."""
    instruction = {spec.id: spec.instruction for spec in await envs.list_envs()}[FROZENLAKE]
    windowed = 0
    for seed in range(8):
        trajectory = await run_chat_episode(
            make_job(FROZENLAKE, seed, max_turns=5, history_turns=1, action_format="plain"),
            envs,
            chat,
            instruction,
        )
        turns = trajectory.turns
        for index, turn in enumerate(turns):
            kept = max(0, index - 1)
            messages = [{"role": "user", "content": f"{instruction}\n\n{turns[kept].observation}"}]
            for earlier in range(kept, index):
                messages += [
                    {"role": "assistant", "content": turns[earlier].response},
                    {"role": "user", "content": turns[earlier + 1].observation},
                ]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert turn.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        windowed += len(turns) >= 3
    assert windowed, "a random policy should play three turns in some of 8 episodes"


async def test_openai_engine_truncates_at_the_context_limit(envs: EnvClient, chat: OpenAIChatClient) -> None:
    job = make_job(BANDIT, 1, sampling=SamplingParams(max_tokens=4096))
    with pytest.raises(EngineContextLengthError):
        await chat.chat([{"role": "user", "content": "hi"}], job.sampling)
    trajectory = await run_chat_episode(job, envs, chat, "Pick an arm.")
    assert trajectory.truncated and trajectory.num_turns == 0 and trajectory.text_only


# -- the CLI -----------------------------------------------------------------------------------


def test_eval_with_a_model_dir_starts_and_stops_its_services(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run" / "trajectories.jsonl"
    args = ["eval", "--model", str(model_dir), "--env", FROZENLAKE, "--env", BANDIT]
    # --max-tokens only keeps the test fast: a random model at temperature 0 rambles for 100+ tokens.
    # --history-turns 1: from the third turn on, every turn is a sequence of its own.
    result = stargym(
        *args,
        "--episodes",
        "16",
        "--max-turns",
        "4",
        "--max-tokens",
        "32",
        "--history-turns",
        "1",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    for header in ("success", "mean return", "mean turns", "invalid actions", "truncated", "errors"):
        assert header in result.stdout
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│ game/" in line}
    assert set(rows) == {FROZENLAKE, BANDIT}
    assert all(re.search(r"│\s+16\s+│", row) for row in rows.values())

    trajectories = read_trajectories(out)
    assert len(trajectories) == 32
    assert Counter(t.env for t in trajectories) == {FROZENLAKE: 16, BANDIT: 16}
    for env in (FROZENLAKE, BANDIT):
        assert sorted(t.seed for t in trajectories if t.env == env) == list(range(16))
    for trajectory in trajectories:
        assert trajectory.error is None and trajectory.trainable and not trajectory.text_only
        assert 1 <= trajectory.num_turns <= 4 and sum(trajectory.loss_mask) >= trajectory.num_turns
        assert trajectory.sampling.temperature == 0.0 and trajectory.sampling.seed == trajectory.seed
        assert trajectory.history_turns == 1 and len(trajectory.segments) == max(0, trajectory.num_turns - 2)
    summary = orjson.loads((out.parent / "trajectories.summary.json").read_bytes())
    assert [row["env"] for row in summary["envs"]] == [FROZENLAKE, BANDIT]
    assert all(row["episodes"] == 16 and row["errors"] == 0 for row in summary["envs"])

    # The engine and the game server it started are gone.
    logs = sorted((out.parent / "logs").glob("*.log"))
    assert {log.name.split("-")[0] for log in logs} == {"engine", "game"}
    for log in logs:
        assert not listening(int(log.stem.rsplit("-", 1)[1]))


def test_eval_options_reach_every_episode(model_dir: Path, tmp_path: Path) -> None:
    """``--options``: web/shop's test goals, started on the results page, in every episode."""
    from env_server.envs.web.catalog import generate_catalog

    out = tmp_path / "run" / "trajectories.jsonl"
    options = '{"split": "test", "start": "results"}'
    args = ["eval", "--model", str(model_dir), "--env", "web/shop", "--options", options, "--episodes", "3"]
    result = stargym(*args, "--max-turns", "1", "--max-tokens", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    test_goals = generate_catalog().goals["test"]
    trajectories = read_trajectories(out)
    assert len(trajectories) == 3
    for trajectory in trajectories:
        assert trajectory.options == {"split": "test", "start": "results"} and trajectory.error is None
        first = trajectory.turns[0].observation
        assert first.startswith("Instruction: [SEP] ") and "Total results" in first
        assert test_goals[trajectory.seed % len(test_goals)].instruction in first


def test_eval_against_an_openai_compatible_endpoint(
    engine_server: RunningServer, game_server: RunningServer, tmp_path: Path
) -> None:
    out = tmp_path / "openai.jsonl"
    result = stargym(
        "eval",
        "--openai-base-url",
        f"{engine_server.url}/v1",
        "--openai-model",
        SERVED_NAME,
        "--api-key-env",
        "EVAL_TEST_KEY",
        "--env",
        FROZENLAKE,
        "--env-url",
        f"game={game_server.url}",
        "--episodes",
        "6",
        "--max-turns",
        "2",
        "--max-tokens",
        "8",
        "--temperature",
        "1",
        "--out",
        str(out),
        env={"EVAL_TEST_KEY": API_TOKEN},
    )
    assert result.returncode == 0, result.stderr
    assert FROZENLAKE in result.stdout
    trajectories = read_trajectories(out)
    assert len(trajectories) == 6
    for trajectory in trajectories:
        assert trajectory.text_only and not trajectory.trainable and trajectory.error is None
        assert trajectory.action_format == "answer_tags" and trajectory.token_ids == []
    assert not (tmp_path / "logs").exists()  # nothing was started: the game server was given


def test_eval_against_a_running_engine(
    engine_server: RunningServer, game_server: RunningServer, tmp_path: Path
) -> None:
    """``--engine-url``: token-level episodes; the tokenizer is the model directory the server reports."""
    out = tmp_path / "engine.jsonl"
    result = stargym(
        "eval",
        "--engine-url",
        engine_server.url,
        "--env",
        BANDIT,
        "--env-url",
        f"game={game_server.url}",
        "--episodes",
        "4",
        "--max-turns",
        "2",
        "--temperature",
        "1",
        "--max-tokens",
        "16",
        "--out",
        str(out),
        env={"STARGYM_ROLLOUT_ENGINE_API_TOKEN": API_TOKEN},
    )
    assert result.returncode == 0, result.stderr
    trajectories = read_trajectories(out)
    assert [t.seed for t in sorted(trajectories, key=lambda t: t.seed)] == [0, 1, 2, 3]
    assert all(t.trainable and t.action_format == "plain" and t.token_ids for t in trajectories)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--env", "game/nosuch", "--model", "{model}"], {}, "unknown env 'game/nosuch'"),
        (["--env", "nosuch", "--model", "{model}"], {}, "env ids look like 'family/name'"),
        (["--env", FROZENLAKE, "--engine-url", "http://127.0.0.1:{dead}"], {}, "cannot reach the engine"),
        (
            ["--env", FROZENLAKE, "--openai-base-url", "http://127.0.0.1:{dead}/v1", "--openai-model", "m"],
            {"OPENAI_API_KEY": ""},
            "OPENAI_API_KEY is not set",
        ),
        (
            ["--env", FROZENLAKE, "--openai-base-url", "{engine}/v1", "--openai-model", SERVED_NAME],
            {"OPENAI_API_KEY": "wrong"},
            "refused the API key",
        ),
        (["--env", FROZENLAKE], {}, "choose exactly one engine"),
        (["--env", FROZENLAKE, "--model", "{model}", "--engine-url", "http://x"], {}, "choose exactly one"),
        (["--env", FROZENLAKE, "--model", "/nonexistent"], {}, "not a Hugging Face model directory"),
        (["--env", FROZENLAKE, "--model", "{model}", "--env-url", "game"], {}, "must be FAMILY=URL"),
        (["--env", FROZENLAKE, "--model", "{model}", "--action-format", "xml"], {}, "unknown action format"),
        (
            ["--env", "web/shop", "--model", "{model}", "--options", "{{split: test"],
            {},
            "--options is not JSON",
        ),
        (["--env", "web/shop", "--model", "{model}", "--options", "[1]"], {}, "must be a JSON object"),
        (
            ["--env", "web/shop", "--model", "{model}", "--options", '{{"split": "holdout"}}'],
            {},
            "--options for web/shop: split:",
        ),
    ],
)
def test_bad_input_exits_with_a_clear_message(
    args: list[str], env: dict[str, str], message: str, model_dir: Path, engine_server: RunningServer
) -> None:
    values = {"model": str(model_dir), "dead": str(free_port()), "engine": engine_server.url}
    result = stargym("eval", *(arg.format(**values) for arg in args), env=env)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("error:")
