"""ScalingInter-RL horizon schedule."""

from __future__ import annotations

import pytest

from trainer.algorithms.curriculum import HorizonSchedule, StageChange

SCHEDULE = HorizonSchedule([[0, 6], [100, 13], [200, 20]])


@pytest.mark.parametrize(
    ("step", "stage", "turns"),
    [
        (0, 0, 6),
        (1, 0, 6),
        (99, 0, 6),
        (100, 1, 13),
        (150, 1, 13),
        (199, 1, 13),
        (200, 2, 20),
        (10_000, 2, 20),
    ],
)
def test_lookups(step: int, stage: int, turns: int) -> None:
    assert SCHEDULE.stage(step) == stage
    assert SCHEDULE.max_turns(step) == turns


def test_negative_step_is_an_error() -> None:
    with pytest.raises(ValueError):
        SCHEDULE.max_turns(-1)


def test_stage_changes_for_logging() -> None:
    assert SCHEDULE.change_at(0) is None
    assert SCHEDULE.change_at(99) is None
    change = SCHEDULE.change_at(100)
    assert change == StageChange(step=100, stage=1, previous_max_turns=6, max_turns=13)
    assert "6 -> 13" in change.message
    assert SCHEDULE.change_at(101) is None
    assert SCHEDULE.changes_between(50, 60) == []
    # a resume that jumps over both boundaries reports both, oldest first
    assert [c.stage for c in SCHEDULE.changes_between(10, 250)] == [1, 2]
    assert [c.max_turns for c in SCHEDULE.changes_between(199, 200)] == [20]


def test_constant_and_config_round_trip() -> None:
    assert HorizonSchedule.from_config(8).max_turns(1000) == 8
    assert HorizonSchedule.constant(8).change_at(1) is None
    assert HorizonSchedule.from_config([[0, 5], [100, 8], [200, 10]]).to_config() == [
        [0, 5],
        [100, 8],
        [200, 10],
    ]
    assert HorizonSchedule(SCHEDULE.to_config()) == SCHEDULE
    assert len(SCHEDULE) == 3
    assert SCHEDULE.final_max_turns == 20


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([], "at least one"),
        ("0,6", "at least one"),
        ([[10, 6], [100, 13]], "start at step 0"),
        ([[0, 6], [200, 13], [100, 20]], "strictly increasing"),
        ([[0, 6], [0, 13]], "strictly increasing"),
        ([[0, 0]], "positive"),
        ([[0, 6], [100, -1]], "positive"),
        ([[0, 6.5]], "int"),
        ([[0, True]], "int"),
        ([[0, 6, 1]], "pair"),
        ([6], "pair"),
    ],
)
def test_validation_errors(stages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HorizonSchedule(stages)
