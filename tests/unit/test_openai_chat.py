"""The openai engine's pieces on their own: text-only trajectories, the client's retries and errors.

The client (the ``openai`` package's, wrapped) talks to a scripted in-process aiohttp server that
answers as OpenAI's API does (its error bodies, ``Retry-After``, a null ``content``); the
real-server tests are in ``tests/integration/test_eval.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from rollout_server.openai_chat import (
    MissingAPIKeyError,
    OpenAIAuthError,
    OpenAIChatClient,
    api_key_from_env,
    normalise_base_url,
)
from services.engine_client import EngineBusyError, EngineContextLengthError, EngineServerError
from services.rollout_protocol import RolloutJob, SamplingParams, Trajectory, Turn

# -- text-only trajectories ----------------------------------------------------------------------


def job() -> RolloutJob:
    return RolloutJob(run_id="r", env="game/frozenlake", seed=1, group_id="g", max_turns=3, policy_version=0)


def turn(**overrides: Any) -> Turn:
    fields = {
        "observation": "P _ G",
        "response": "<think>go</think><answer>Right</answer>",
        "actions": ["Right"],
        "reward": 1.0,
        "done": True,
        "valid": True,
        "policy_version": 0,
        "prompt_tokens": 120,
        "response_tokens": 9,
    }
    return Turn(**(fields | overrides))


def test_text_only_trajectory_is_valid_without_tokens_and_never_trainable() -> None:
    trajectory = Trajectory.from_job(
        job(), turns=[turn()], num_turns=1, reward=1.0, success=True, worker_id="eval", text_only=True
    )
    # response_tokens are the API's usage counts, not positions in an (absent) loss mask.
    assert trajectory.turns[0].response_tokens == 9 and trajectory.loss_mask == []
    assert not trajectory.trainable
    assert "text-only" in (trajectory.untrainable_reason or "")
    assert Trajectory.model_validate_json(trajectory.model_dump_json()) == trajectory
    assert "trainable" not in trajectory.model_dump()  # a property, not a wire field


def test_text_only_trajectory_refuses_token_fields() -> None:
    with pytest.raises(ValidationError, match="text-only trajectory carries no token_ids"):
        Trajectory.from_job(
            job(),
            turns=[turn(response_tokens=1)],
            num_turns=1,
            token_ids=[5],
            loss_mask=[1],
            logprobs=[-0.5],
            worker_id="eval",
            text_only=True,
        )


def test_token_trajectories_are_trainable_unless_failed() -> None:
    tokens = {"token_ids": [3, 4, 5], "loss_mask": [0, 0, 1], "logprobs": [0.0, 0.0, -0.2]}
    good = Trajectory.from_job(job(), turns=[turn(response_tokens=1)], num_turns=1, worker_id="w", **tokens)
    assert good.trainable and good.untrainable_reason is None and not good.text_only
    failed = Trajectory.from_job(job(), worker_id="w", error="EpisodeEnvError: step failed")
    assert not failed.trainable and "step failed" in (failed.untrainable_reason or "")
    # Without text_only the loss mask must still cover exactly the sampled tokens.
    with pytest.raises(ValidationError, match="loss_mask covers"):
        Trajectory.from_job(job(), turns=[turn()], num_turns=1, worker_id="w", **tokens)


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8210", "http://127.0.0.1:8210/v1"),
        ("http://127.0.0.1:8210/", "http://127.0.0.1:8210/v1"),
        ("https://api.openai.com/v1/", "https://api.openai.com/v1"),
        ("https://example.org/openai/v1", "https://example.org/openai/v1"),
    ],
)
def test_base_url_follows_the_sdk_convention(given: str, expected: str) -> None:
    assert normalise_base_url(given) == expected


def test_bad_base_url_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        normalise_base_url("api.openai.com")


def test_api_key_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", " sk-test ")
    assert api_key_from_env("MY_KEY") == "sk-test"
    monkeypatch.setenv("MY_KEY", "")
    with pytest.raises(MissingAPIKeyError, match="MY_KEY is not set"):
        api_key_from_env("MY_KEY")
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(MissingAPIKeyError, match="--api-key-env"):
        api_key_from_env("MY_KEY")


def test_chat_body_holds_openai_fields_only() -> None:
    client = OpenAIChatClient("http://h:1", "gpt-4o", "k")
    messages = [{"role": "user", "content": "hi"}]
    body = client.chat_body(messages, SamplingParams(temperature=0.0, max_tokens=32))
    assert body == {
        "model": "gpt-4o",
        "messages": messages,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 32,
    }
    body = client.chat_body(messages, SamplingParams(seed=4, top_k=5), seed=9)
    assert body["seed"] == 9 and body["extra_body"] == {"top_k": 5}
    newer = OpenAIChatClient("http://h:1", "o3", max_tokens_field="max_completion_tokens")
    assert "max_tokens" not in newer.chat_body(messages, SamplingParams(max_tokens=7))
    assert newer.chat_body(messages, SamplingParams(max_tokens=7))["max_completion_tokens"] == 7


# -- the client against a scripted server ------------------------------------------------------


class Script:
    """Answers ``/v1/chat/completions`` from a list of (status, body, headers), then repeats the last."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, dict[str, Any], dict[str, str]]] = []
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        self.auth.append(request.headers.get("Authorization"))
        status, body, headers = self.answers[min(len(self.requests), len(self.answers)) - 1]
        return web.json_response(body, status=status, headers=headers)


def reply(content: str | None, finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
    }


def openai_error(message: str, code: str | None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[Script, str]]:
    script = Script()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", script.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield script, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


MESSAGES = [{"role": "user", "content": "P _ G"}]


async def test_reply_and_usage_are_read(scripted: tuple[Script, str]) -> None:
    script, url = scripted
    script.answers = [(200, reply("<answer>Right</answer>", "length"), {})]
    async with OpenAIChatClient(url, "gpt-4o", "sk-1") as client:
        answer = await client.chat(MESSAGES, SamplingParams(max_tokens=3, seed=2))
    assert answer.content == "<answer>Right</answer>" and answer.finish_reason == "length"
    assert (answer.prompt_tokens, answer.completion_tokens) == (11, 3)
    assert script.auth == ["Bearer sk-1"] and script.requests[0]["seed"] == 2


async def test_null_content_is_an_empty_reply(scripted: tuple[Script, str]) -> None:
    script, url = scripted
    script.answers = [(200, reply(None), {})]
    async with OpenAIChatClient(url, "gpt-4o") as client:
        assert (await client.chat(MESSAGES, SamplingParams(top_k=4))).content == ""
    assert script.auth == ["Bearer EMPTY"]  # no key: the placeholder the SDK needs
    assert script.requests[0]["top_k"] == 4  # sent in the body, beside OpenAI's own fields


async def test_rate_limits_and_server_errors_are_retried(scripted: tuple[Script, str]) -> None:
    script, url = scripted
    script.answers = [
        (429, openai_error("Rate limit reached", "rate_limit_exceeded", "requests"), {"Retry-After": "0.01"}),
        (503, {"error": {"message": "overloaded"}}, {}),
        (200, reply("ok"), {}),
    ]
    async with OpenAIChatClient(url, "m") as client:
        assert (await client.chat(MESSAGES, SamplingParams())).content == "ok"
    assert len(script.requests) == 3


async def test_errors_are_typed(scripted: tuple[Script, str]) -> None:
    script, url = scripted
    async with OpenAIChatClient(url, "m", retries=2) as client:
        script.answers = [(401, openai_error("Incorrect API key provided", "invalid_api_key"), {})]
        with pytest.raises(OpenAIAuthError, match="Incorrect API key"):
            await client.chat(MESSAGES, SamplingParams())
        assert len(script.requests) == 1  # never retried
        script.requests.clear()
        script.answers = [
            (
                400,
                openai_error(
                    "This model's maximum context length is 8192 tokens.", "context_length_exceeded"
                ),
                {},
            )
        ]
        with pytest.raises(EngineContextLengthError):
            await client.chat(MESSAGES, SamplingParams())
        script.requests.clear()
        script.answers = [
            (
                429,
                openai_error("You exceeded your current quota", "insufficient_quota"),
                {"Retry-After": "0.01", "x-should-retry": "false"},
            )
        ]
        with pytest.raises(EngineBusyError, match="quota"):
            await client.chat(MESSAGES, SamplingParams())
        assert len(script.requests) == 1  # the server said no retry helps
        script.requests.clear()
        script.answers = [(500, {"error": {"message": "boom"}}, {"Retry-After": "0.01"})]
        with pytest.raises(EngineServerError, match="boom"):
            await client.chat(MESSAGES, SamplingParams())
        assert len(script.requests) == 3  # the first try and two retries
