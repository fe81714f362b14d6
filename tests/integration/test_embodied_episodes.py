"""Rollout episodes on the embodied family: the tiny policy on the CPU engine plays BabyAI and
ScienceWorld over HTTP (one real ``stargym env serve embodied``), as a rollout worker does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningServer, free_port, start_engine, start_server, stop_server
from transformers import AutoTokenizer

from deploy.model_init import init_tiny_model
from rollout_server.episode import run_episode
from services.engine_client import EngineClient
from services.env_client import EnvClient
from services.rollout_protocol import RolloutJob, SamplingParams, Trajectory

BABYAI = "embodied/babyai"
SCIWORLD = "embodied/sciworld"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # BabyAI's texts only: ScienceWorld's words are then several byte-level tokens each, which
    # the episode must handle as well as single-token actions.
    return init_tiny_model(tmp_path_factory.mktemp("embodied-model") / "policy", 0, [BABYAI], 10, 10)


@pytest.fixture(scope="module")
def embodied_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    port = free_port()
    server = start_server(
        ["env", "serve", "embodied", "--port", str(port)],
        port,
        tmp_path_factory.mktemp("embodied"),
        env={"STARGYM_SCIWORLD_POOL_SIZE": "2"},
        name="embodied",
    )
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def engine_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_engine(model_dir, tmp_path_factory.mktemp("embodied-engine"))
    yield server
    stop_server(server.process)


@pytest.fixture
async def envs(embodied_server: RunningServer) -> AsyncIterator[EnvClient]:
    async with EnvClient(embodied_server.url, timeout=60.0) as client:
        yield client


@pytest.fixture
async def engine(engine_server: RunningServer) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine_server.url, timeout=120.0) as client:
        yield client


def job(env: str, seed: int, options: dict[str, Any] | None, max_turns: int, max_tokens: int) -> RolloutJob:
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed)
    return RolloutJob(
        run_id="test",
        group_id=f"{env}-{seed}",
        env=env,
        seed=seed,
        options=options,
        sampling=sampling,
        max_turns=max_turns,
        policy_version=0,
    )


def check_aligned(trajectory: Trajectory) -> None:
    """Every token has its behaviour log-prob and mask, and only sampled tokens are trained on."""
    assert len(trajectory.token_ids) == len(trajectory.logprobs) == len(trajectory.loss_mask)
    sampled = sum(trajectory.loss_mask)
    assert 0 < sampled == sum(turn.response_tokens for turn in trajectory.turns)


async def play(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, jobs: list[RolloutJob]
) -> list[Trajectory]:
    instructions = {spec.id: spec.instruction for spec in await envs.list_envs()}
    before = {i.instance_id for i in (await envs.list_instances()).instances}
    trajectories = await asyncio.gather(
        *(run_episode(j, envs, engine, tokenizer, instructions[j.env], 0, max_model_len=2048) for j in jobs)
    )
    after = {i.instance_id for i in (await envs.list_instances()).instances}
    assert after <= before  # every instance closed, so every JVM is back in the pool
    return list(trajectories)


async def test_babyai_episodes(envs: EnvClient, engine: EngineClient, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jobs = [job(BABYAI, seed, {"level": "BabyAI-GoToRedBall-v0"}, 4, 1) for seed in range(6)]
    for trajectory in await play(envs, engine, tokenizer, jobs):
        check_aligned(trajectory)
        assert trajectory.env == BABYAI and 1 <= trajectory.num_turns <= 4
        assert (
            trajectory.turns[0].observation.startswith("Your goal: go to ")
            and "red ball" in trajectory.turns[0].observation
        )
        for turn in trajectory.turns:
            assert "Available actions: [" in turn.observation
            assert turn.response_tokens == 1  # every GoToRedBall action is one token of this policy
        assert trajectory.success == (trajectory.reward > 0)


async def test_sciworld_episodes_share_the_jvm_pool(
    envs: EnvClient, engine: EngineClient, model_dir: Path
) -> None:
    """Four episodes on a pool of two JVMs: the later creates wait for the first to close."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jobs = [job(SCIWORLD, seed, {"task": "find-living-thing"}, 2, 6) for seed in range(4)]
    for trajectory in await play(envs, engine, tokenizer, jobs):
        check_aligned(trajectory)
        assert trajectory.env == SCIWORLD and 1 <= trajectory.num_turns <= 2
        assert "Your task is to find a(n) living thing" in trajectory.turns[0].observation
        assert not trajectory.success
