"""The rollout wire models: what they accept, what they refuse, and that JSON round-trips exactly."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.rollout_protocol import PolicyPointer, RolloutJob, SamplingParams, Trajectory, Turn


def make_job(**overrides: Any) -> RolloutJob:
    fields: dict[str, Any] = {
        "run_id": "run-1",
        "env": "game/frozenlake",
        "seed": 7,
        "group_id": "g-7",
        "max_turns": 4,
        "policy_version": 3,
    }
    return RolloutJob(**(fields | overrides))


def make_turn(**overrides: Any) -> Turn:
    fields: dict[str, Any] = {
        "observation": "You are at S.",
        "response": "down",
        "actions": ["down"],
        "reward": 0.0,
        "done": False,
        "valid": True,
        "policy_version": 3,
        "prompt_tokens": 3,
        "response_tokens": 1,
    }
    return Turn(**(fields | overrides))


def trajectory_fields(**overrides: Any) -> dict[str, Any]:
    """Two turns: 3 prompt tokens + 1 sampled, then 2 prompt tokens + 2 sampled."""
    fields: dict[str, Any] = {
        **make_job().model_dump(),
        "turns": [make_turn(), make_turn(prompt_tokens=2, response_tokens=2, reward=1.0, done=True)],
        "token_ids": [10, 11, 12, 40, 13, 14, 41, 42],
        "loss_mask": [0, 0, 0, 1, 0, 0, 1, 1],
        "logprobs": [0.0, 0.0, 0.0, -0.5, 0.0, 0.0, -1.25, -0.01],
        "reward": 1.0,
        "success": True,
        "num_turns": 2,
        "timings": {"total_s": 0.5},
        "worker_id": "worker-a",
    }
    return fields | overrides


def test_job_defaults_are_filled_and_json_round_trips() -> None:
    job = make_job(action_format="plain", options={"size": 4})
    assert len(job.job_id) == 32 and job.created_at > 0
    assert job.sampling == SamplingParams()
    assert RolloutJob.model_validate_json(job.model_dump_json()) == job


def test_trajectory_json_round_trips() -> None:
    trajectory = Trajectory.model_validate(trajectory_fields())
    assert Trajectory.model_validate_json(trajectory.model_dump_json()) == trajectory


@pytest.mark.parametrize("model", [RolloutJob, Trajectory, Turn, SamplingParams, PolicyPointer])
def test_unknown_fields_are_refused(model: type) -> None:
    valid = {
        RolloutJob: lambda: make_job().model_dump(),
        Trajectory: trajectory_fields,
        Turn: lambda: make_turn().model_dump(),
        SamplingParams: dict,
        PolicyPointer: lambda: {"version": 1, "path": "/ckpt/policy-v1"},
    }[model]()
    model.model_validate(valid)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        model.model_validate({**valid, "surprise": 1})


@pytest.mark.parametrize(
    "bad",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"max_tokens": 0}, {"seed": -1}],
)
def test_sampling_bounds(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_turns": 0},
        {"seed": -1},
        {"env": ""},
        {"policy_version": -1},
        {"action_format": "json"},
        {"kind": "agent"},  # derived from agent, never sent
        {"agent": "examples.openai_agent"},  # no function
        {"agent": "ftp://harness"},
        {"agent": "push"},
    ],
)
def test_job_refuses_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        make_job(**bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"logprobs": [0.0] * 7}, "one length"),
        ({"loss_mask": [0, 0, 0, 2, 0, 0, 1, 1]}, "only 0 and 1"),
        ({"logprobs": [0.0, -0.3, 0.0, -0.5, 0.0, 0.0, -1.25, -0.01]}, "0.0 where loss_mask is 0"),
        ({"num_turns": 1}, "num_turns"),
        ({"max_turns": 1}, "exceeds max_turns"),
        (
            {
                "loss_mask": [0, 0, 1, 1, 0, 0, 1, 1],
                "logprobs": [0.0, 0.0, -0.1, -0.5, 0.0, 0.0, -1.25, -0.01],
            },
            "covers",
        ),
        ({"policy_version": 2}, "oldest version"),
        ({"reward": float("nan")}, "finite"),
        ({"timings": {"total_s": float("inf")}}, "finite"),
        ({"worker_id": ""}, "at least 1"),
        ({"segments": [0]}, "segments must rise strictly"),
        ({"segments": [4, 4]}, "segments must rise strictly"),
        ({"segments": [8]}, "segments must rise strictly"),
    ],
)
def test_trajectory_consistency_is_enforced(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Trajectory.model_validate(trajectory_fields(**overrides))


@pytest.mark.parametrize("agent", ["examples.openai_agent:play", "http://harness:9000/episodes", "pull"])
def test_an_agent_job_names_a_function_or_a_harness_url(agent: str) -> None:
    job = make_job(agent=agent)
    assert job.kind == "agent" and make_job().kind == "env"
    assert RolloutJob.model_validate_json(job.model_dump_json()) == job
    assert Trajectory.model_validate(trajectory_fields(agent=agent, segments=[4])).segments == [4]


def test_a_history_window_belongs_to_the_workers_loop() -> None:
    job = make_job(history_turns=0)
    assert RolloutJob.model_validate_json(job.model_dump_json()).history_turns == 0
    with pytest.raises(ValidationError, match="an agent keeps its own history"):
        make_job(agent="examples.openai_agent:play", history_turns=2)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        make_job(history_turns=-1)


@pytest.mark.parametrize(
    ("overrides", "share"),
    [
        ({}, 0.0),
        ({"valid": False, "invalid_actions": 1}, 1.0),
        ({"valid": False, "actions": ["down", "jump", "fly"], "invalid_actions": 2}, 2 / 3),
        ({"valid": False, "actions": [], "invalid_actions": 0}, 1.0),  # nothing parsed
        ({"valid": False}, 1.0),  # a sender that does not count (an agent's turn)
    ],
)
def test_a_turns_invalid_share(overrides: dict[str, Any], share: float) -> None:
    assert make_turn(**overrides).invalid_share == pytest.approx(share)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"valid": False, "invalid_actions": 2}, "exceeds the turn's 1 actions"),
        ({"invalid_actions": 1}, "a valid turn has no invalid actions"),
        ({"invalid_actions": -1}, "greater than or equal to 0"),
    ],
)
def test_a_turns_invalid_count_is_checked(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make_turn(**overrides)


def test_trajectory_version_is_the_oldest_turn_version() -> None:
    fields = trajectory_fields(policy_version=2)
    fields["turns"][1] = fields["turns"][1].model_copy(update={"policy_version": 2})
    assert Trajectory.model_validate(fields).policy_version == 2


def test_empty_failed_trajectory_is_valid() -> None:
    """An episode that failed before its first turn still reports its job and its error."""
    trajectory = Trajectory.from_job(make_job(), error="env unreachable", worker_id="w")
    assert trajectory.num_turns == 0 and trajectory.token_ids == [] and trajectory.error == "env unreachable"


def test_from_job_copies_every_job_field() -> None:
    job = make_job(options={"size": 4}, sampling=SamplingParams(temperature=0.7, top_k=5, seed=1))
    fields = trajectory_fields()
    results = {key: fields[key] for key in fields.keys() - RolloutJob.model_fields.keys()}
    trajectory = Trajectory.from_job(job, **results)
    assert trajectory.model_dump(include=set(RolloutJob.model_fields)) == job.model_dump()


def test_policy_pointer_hash_round_trip_with_bytes() -> None:
    pointer = PolicyPointer(version=12, path="/ckpt/run/policy-v12")
    as_redis_returns_it = {k.encode(): v.encode() for k, v in pointer.to_hash().items()}
    assert PolicyPointer.from_hash(as_redis_returns_it) == pointer
    with pytest.raises(ValidationError):
        PolicyPointer(version=-1, path="x")
