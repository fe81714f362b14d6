"""bench/lake_references.py: the reference policies that give a FrozenLake success rate its meaning."""

from __future__ import annotations

import itertools
from pathlib import Path

from bench.lake_references import (
    Lake,
    best_blind_route,
    play,
    prefer,
    shortest_path_solves,
    solves_by_route,
    split_by_blind_route,
)
from env_server.envs.game.frozenlake import ACTION_NAMES, FrozenLakeOptions
from services.rollout_protocol import Trajectory

LAKES = [Lake(seed, FrozenLakeOptions(size=4)) for seed in range(12)]


def test_the_pruned_search_finds_the_best_route_that_exhaustive_search_finds() -> None:
    exhaustive = max(
        sum(solves_by_route(lake, route, 6) for lake in LAKES)
        for route in itertools.product(ACTION_NAMES, repeat=6)
    )
    route, solved = best_blind_route(LAKES, 6)
    assert solved == exhaustive
    assert solved == sum(solves_by_route(lake, route, 6) for lake in LAKES)
    assert len(route) == 6  # edge bumps dropped; on these maps the best route takes no detour
    assert 0 < solved < len(LAKES)  # these maps differ: no one route solves them all


def test_a_shortest_path_is_six_moves_from_corner_to_corner() -> None:
    assert all(shortest_path_solves(lake, 6) for lake in LAKES)
    assert not any(shortest_path_solves(lake, 5) for lake in LAKES)


def test_prefer_reads_the_tiles_next_to_the_player() -> None:
    right_else_down = prefer("Right", "Down")
    assert right_else_down("P _ _\n_ _ _\n_ _ G\nReach G and avoid O.") == "Right"
    assert right_else_down("P O _\n_ _ _\n_ _ G\nReach G and avoid O.") == "Down"
    assert right_else_down("_ _ P\n_ _ _\n_ _ G\nReach G and avoid O.") == "Down"  # the edge
    nowhere_safe = "P O _\nO _ _\n_ _ G\nReach G and avoid O."
    assert right_else_down(nowhere_safe) == "Right"  # its first choice
    assert sum(play(lake, right_else_down, 8) for lake in LAKES) > 0


def test_a_policy_is_split_by_whether_the_blind_route_solves_its_maps(tmp_path: Path) -> None:
    route, _ = best_blind_route(LAKES, 8)
    solved = [lake.seed for lake in LAKES if solves_by_route(lake, route, 8)]
    unsolved = [lake.seed for lake in LAKES if not solves_by_route(lake, route, 8)]
    assert solved and unsolved
    # A policy that wins exactly on the blind route's maps: 1.0 there, 0.0 elsewhere.
    path = tmp_path / "trajectories.jsonl"
    path.write_text(
        "".join(
            Trajectory(
                run_id="eval",
                env="game/frozenlake",
                seed=seed,
                group_id=str(seed),
                max_turns=8,
                policy_version=0,
                worker_id="eval",
                options={"size": 4},
                success=seed in solved,
            ).model_dump_json()
            + "\n"
            for seed in solved + unsolved
        )
    )
    split = split_by_blind_route(path, route, 8)
    assert split["episodes"] == len(LAKES)
    assert split["maps_blind_route_solves"] == {"episodes": len(solved), "success": 1.0}
    assert split["maps_it_does_not"] == {"episodes": len(unsolved), "success": 0.0}
