"""bench/first_moves.py: P(first move) of a run's published policies, read as the engine reads prompts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from synthetic import one_turn_trajectory
from transformers import AutoTokenizer

from bench.first_moves import INVALID, first_move_probabilities, first_prompts, move_token_ids
from deploy.model_init import init_tiny_model
from env_server.envs.game.frozenlake import ACTION_NAMES


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", 0, ["game/frozenlake"], 10, 5)


def test_every_move_is_counted_under_both_of_its_one_token_spellings(policy: Path) -> None:
    spellings = move_token_ids(AutoTokenizer.from_pretrained(policy))
    assert list(spellings) == ACTION_NAMES
    assert all(len(ids) == 2 for ids in spellings.values()), spellings  # "Right" and " Right"
    assert len({token for ids in spellings.values() for token in ids}) == 8


def test_prompts_of_different_lengths_read_as_each_would_alone(policy: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(policy)
    long = tokenizer.encode("P _ _ _\n_ O _ _\n_ _ _ O\nO _ _ G\nReach G and avoid O.")
    short = tokenizer.encode("_ P _ _\nReach G and avoid O.")
    assert len(long) > len(short)
    run_dir = tmp_path / "run"
    shutil.copytree(policy, run_dir / "policy-v0")
    (run_dir / "eval-after").mkdir()
    lines = [one_turn_trajectory(long, move_token_ids(tokenizer)["Down"][0]), one_turn_trajectory(short, 5)]
    (run_dir / "eval-after" / "trajectories.jsonl").write_text(
        "".join(trajectory.model_dump_json() + "\n" for trajectory in lines)
    )

    prompts = first_prompts(run_dir, 8)
    assert prompts == [long, short]  # cut at the first sampled token
    together = first_move_probabilities(run_dir / "policy-v0", prompts)
    alone = [first_move_probabilities(run_dir / "policy-v0", [prompt]) for prompt in prompts]
    assert list(together) == [*ACTION_NAMES, INVALID]
    assert sum(together.values()) == pytest.approx(1.0)
    for key, share in together.items():
        assert share == pytest.approx((alone[0][key] + alone[1][key]) / 2, abs=1e-5)
    # Random weights: no move is likely yet, and the two prompts are read differently.
    assert together[INVALID] > 0.9 and alone[0] != alone[1]
