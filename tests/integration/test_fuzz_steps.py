"""Fuzzing: the action parsers and every registered env's step take any string a model may say.

A policy early in training says anything: nothing, a megabyte, control characters, lone UTF-16
surrogates (JSON's ``"\\ud800"`` decodes to one), ``||`` storms that split into thousands of
actions. Each must come back as a reply the parser understood or refused, and as an observation
from the env, never as an exception: in the env host an exception is a failed instance, and a
step result orjson cannot encode would be a 500 instead of an answer.

Every env of every family runs in this process (the same classes the env servers host, with
their real packages and data), each stepped through :func:`env_server.pool.play_turn`, the
host's own multi-action path; ScienceWorld gets a JVM of its own for its test.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest
from conftest import RunningServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from env_server.core import Env, Step
from env_server.envs.reasoning.env import MAX_ATTEMPTS
from env_server.pool import HostOptions, play_turn
from env_server.registry import load_family
from rollout_server.actions import ACTION_FORMATS, env_action, parse_reply
from services.contracts import ACTION_SEPARATOR
from services.http_app import dumps_json

FAMILIES = ("game", "embodied", "search", "web", "reasoning", "textarena")
ENV_CLASSES: dict[str, type[Env]] = {
    env_id: env_class for family in FAMILIES for env_id, env_class in load_family(family).items()
}
EXAMPLES_PER_ENV = 12
"""Generated replies per env on top of the fixed hard cases: 129 envs run in about a minute."""
SLOW_ENVS = {"embodied/sciworld": 4}
"""ScienceWorld parses each action in its JVM (~50 ms a step): fewer generated examples."""

HARD_REPLIES = [
    "",
    " \t\n",
    ACTION_SEPARATOR,
    ACTION_SEPARATOR * 5_000,
    "a" + " || a" * 5_000,
    "x" * 2**20,
    "\x00\x01\x7f\x1b[31m",
    "\ud800 lone surrogate \udfff",
    "\u202e\u0301\ufeff\U0001f600 مرحبا 你好",
    "<think></think><answer></answer>",
    "<answer>" * 1_000,
    "{'__class__': 1}\"'; DROP TABLE",
]
REPLIES = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=60).map(lambda text: f"<answer>{text}</answer>"),
    st.lists(st.text(max_size=20), max_size=40).map(ACTION_SEPARATOR.join),
    st.binary(max_size=200).map(lambda raw: raw.decode("latin-1")),
)


@settings(max_examples=300, deadline=None, database=None)
@given(reply=st.one_of(REPLIES, st.sampled_from(HARD_REPLIES)), max_actions=st.integers(1, 8))
def test_the_parsers_split_any_reply_into_at_most_max_actions_clean_actions(
    reply: str, max_actions: int
) -> None:
    for action_format in ACTION_FORMATS:
        parsed = parse_reply(reply, action_format, max_actions)
        assert len(parsed.actions) <= max_actions
        assert parsed.format_ok == (parsed.penalty == 0.0)
        if action_format == "answer_tags":
            assert all(action and action == action.strip() for action in parsed.actions)
            assert (env_action(parsed) is None) == (not parsed.actions)


@pytest.mark.parametrize("env_id", sorted(ENV_CLASSES))
def test_every_env_answers_any_reply_with_an_observation(env_id: str) -> None:
    env_class = ENV_CLASSES[env_id]
    env_class.prepare()
    # A reasoning episode ends at its first answer, and a reset generates a new puzzle (up to
    # 8 s for knight_swap here): as many attempts as allowed keep resets few.
    multi_turn = {"max_attempts": MAX_ATTEMPTS} if "max_attempts" in env_class.Options.model_fields else {}
    options = env_class.Options(**multi_turn)
    seeds = itertools.count()
    env = env_class()
    try:
        asyncio.run(env.start())
        env.reset(next(seeds), options)

        def check(reply: str, max_actions: int) -> None:
            step = play_turn(env, reply, HostOptions(max_actions_per_turn=max_actions))
            assert isinstance(step, Step)
            assert isinstance(step.observation, str) and isinstance(step.reward, float | int)
            # What the host sends back must encode (orjson alone refuses a lone surrogate).
            answer = {"observation": step.observation, "reward": step.reward, "info": step.info}
            assert json.loads(dumps_json(answer)) == json.loads(json.dumps(answer))
            if step.done:
                env.reset(next(seeds), options)

        for reply in HARD_REPLIES:
            check(reply, 1)
            check(reply, 4)

        @settings(
            max_examples=SLOW_ENVS.get(env_id, EXAMPLES_PER_ENV),
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(reply=REPLIES, max_actions=st.integers(1, 4))
        def generated(reply: str, max_actions: int) -> None:
            check(reply, max_actions)

        generated()
    finally:
        env.close()


def test_a_lone_surrogate_over_http_is_an_answer_not_a_500(game_server: RunningServer) -> None:
    with httpx.Client(base_url=game_server.url, timeout=30.0) as client:
        created = client.post("/instances", json={"env": "game/bandit", "seed": 1}).json()
        raw = b'{"action": "\\ud800 Dragon"}'  # JSON's escape of a lone surrogate, as a client sends it
        stepped = client.post(
            f"/instances/{created['instance_id']}/step",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert stepped.status_code == 200, stepped.text
        assert stepped.json()["info"]["valid"] is False
        client.delete(f"/instances/{created['instance_id']}")
