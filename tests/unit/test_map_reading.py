"""bench/map_reading.py: a policy's moves conditioned on the tile beside the player."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lake_references import Lake, Policy, grid, prefer
from bench.map_reading import held_out_files, move_rates, neighbour
from env_server.envs.game.frozenlake import FrozenLakeOptions
from services.rollout_protocol import Trajectory, Turn


def played(seed: int, policy: Policy, max_turns: int = 8) -> Trajectory:
    """A held-out trajectory of ``policy`` on the real env: each turn's observation and move."""
    env, text = Lake(seed, FrozenLakeOptions(size=4)).reset()
    turns = []
    for _ in range(max_turns):
        action = policy(text)
        step = env.step(action)
        turns.append(
            Turn(
                observation=text,
                response=action,
                actions=[action],
                reward=step.reward,
                done=step.done,
                valid=True,
                policy_version=0,
                prompt_tokens=1,
                response_tokens=1,
            )
        )
        if step.done:
            break
        text = step.observation
    return Trajectory(
        run_id="eval",
        env="game/frozenlake",
        seed=seed,
        group_id=str(seed),
        max_turns=max_turns,
        policy_version=0,
        worker_id="eval",
        options={"size": 4},
        success=bool(turns[-1].reward),  # the goal is the only reward
        reward=sum(turn.reward for turn in turns),
        turns=turns,
        num_turns=len(turns),
        token_ids=[0, 1] * len(turns),  # one prompt token and one reply token a turn
        loss_mask=[0, 1] * len(turns),
        logprobs=[0.0, -1.0] * len(turns),
    )


def write(path: Path, episodes: list[Trajectory]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(episode.model_dump_json() + "\n" for episode in episodes))
    return path


def test_the_neighbour_is_ice_a_hole_the_goal_or_the_edge() -> None:
    tiles = grid("_ P O\n_ _ G\n_ _ _\nReach G and avoid O.")
    assert neighbour(tiles, "Right") == "hole"
    assert neighbour(tiles, "Down") == "ice"
    assert neighbour(grid("_ _ P\n_ _ G\n_ _ _\nReach G and avoid O."), "Right") == "edge"
    assert neighbour(grid("_ _ P\n_ _ G\n_ _ _\nReach G and avoid O."), "Down") == "goal"
    assert neighbour(grid("_ _ X\n_ _ G\n_ _ _\nYou fell into a hole."), "Down") is None


def test_a_policy_that_reads_the_map_shows_a_gap_a_blind_one_does_not(tmp_path: Path) -> None:
    seeds = range(1_000_000, 1_000_064)
    reading = move_rates(
        write(tmp_path / "reading.jsonl", [played(s, prefer("Right", "Down")) for s in seeds])
    )
    blind = move_rates(write(tmp_path / "blind.jsonl", [played(s, lambda _text: "Right") for s in seeds]))
    assert reading["Right"]["rate"]["ice"] == 1.0  # it always moves Right when it can
    assert reading["Right"]["rate"]["hole"] < 0.2  # only with a hole (or the edge) below as well
    assert reading["Right"]["gap"] > 0.8
    assert blind["Right"]["rate"] == {kind: 1.0 for kind in blind["Right"]["turns"]}
    assert blind["Right"]["gap"] == 0.0
    assert blind["Down"]["rate"]["ice"] == 0.0
    assert reading["episodes"] == len(seeds)
    assert reading["success"] > blind["success"]
    assert reading["turns"] == sum(len(played(s, prefer("Right", "Down")).turns) for s in seeds)


def test_a_run_directory_gives_its_held_out_policies_in_version_order(tmp_path: Path) -> None:
    episode = [played(1_000_000, prefer("Right", "Down"))]
    for version in (120, 20, 100):
        write(tmp_path / "run" / "held-out" / f"policy-v{version}" / "trajectories.jsonl", episode)
    files = held_out_files(tmp_path / "run")
    assert [path.parent.name for path in files] == ["policy-v20", "policy-v100", "policy-v120"]
    assert held_out_files(files[0]) == [files[0]]
    with pytest.raises(SystemExit, match=r"neither a trajectories\.jsonl nor a run"):
        held_out_files(tmp_path / "empty")
