"""ScalingInter-RL: the interaction horizon (max turns of new jobs) grows with the update step.

``HorizonSchedule([[0, 6], [100, 13], [200, 20]])``: steps 0-99 allow 6 turns, 100-199 allow 13,
200 onward 20. The schedule is a pure function of the step, so resuming from a checkpoint only
needs the step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageChange:
    """A stage boundary crossed between two steps: log it (``train/horizon_stage``)."""

    step: int
    stage: int
    previous_max_turns: int
    max_turns: int

    @property
    def message(self) -> str:
        return (
            f"ScalingInter-RL: step {self.step} enters stage {self.stage}, "
            f"max turns {self.previous_max_turns} -> {self.max_turns}"
        )


class HorizonSchedule:
    """A piecewise-constant map from update step to the max turns of newly issued jobs.

    stages: ``[[start_step, max_turns], ...]``; start steps are ints, strictly increasing, the
    first is 0; max turns are positive ints. Raises ``ValueError`` otherwise.
    """

    def __init__(self, stages: Sequence[Sequence[int]]) -> None:
        if isinstance(stages, str | bytes) or not isinstance(stages, Sequence) or len(stages) == 0:
            raise ValueError("horizon_schedule needs at least one [step, max_turns] pair")
        starts: list[int] = []
        turns: list[int] = []
        for position, pair in enumerate(stages):
            if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(
                    f"horizon_schedule[{position}] must be a [step, max_turns] pair, got {pair!r}"
                )
            step, max_turns = pair
            for name, value in (("step", step), ("max_turns", max_turns)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"horizon_schedule[{position}]: {name} must be an int, got {value!r}")
            if max_turns <= 0:
                raise ValueError(f"horizon_schedule[{position}]: max_turns must be positive, got {max_turns}")
            if position == 0 and step != 0:
                raise ValueError(f"horizon_schedule must start at step 0, got {step}")
            if starts and step <= starts[-1]:
                raise ValueError(
                    f"horizon_schedule steps must be strictly increasing: {step} after {starts[-1]}"
                )
            starts.append(step)
            turns.append(max_turns)
        self._starts = starts
        self._turns = turns

    @classmethod
    def constant(cls, max_turns: int) -> HorizonSchedule:
        """A single stage: ScalingInter-RL off."""
        return cls([[0, max_turns]])

    @classmethod
    def from_config(cls, value: int | Sequence[Sequence[int]]) -> HorizonSchedule:
        """From a config value: a plain int (constant horizon) or a list of pairs."""
        if isinstance(value, int) and not isinstance(value, bool):
            return cls.constant(value)
        return cls(value)

    def to_config(self) -> list[list[int]]:
        return [[step, turns] for step, turns in zip(self._starts, self._turns, strict=True)]

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"HorizonSchedule({self.to_config()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HorizonSchedule) and self.to_config() == other.to_config()

    def __hash__(self) -> int:
        return hash(tuple(map(tuple, self.to_config())))

    def stage(self, step: int) -> int:
        """Index of the stage that ``step`` (>= 0) falls in."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return bisect.bisect_right(self._starts, step) - 1

    def max_turns(self, step: int) -> int:
        """Max turns for jobs issued at update ``step``."""
        return self._turns[self.stage(step)]

    @property
    def final_max_turns(self) -> int:
        return self._turns[-1]

    def changes_between(self, previous_step: int, step: int) -> list[StageChange]:
        """Stage boundaries in ``(previous_step, step]``, oldest first (usually zero or one)."""
        changes = []
        for stage in range(self.stage(previous_step) + 1, self.stage(step) + 1):
            changes.append(
                StageChange(
                    step=self._starts[stage],
                    stage=stage,
                    previous_max_turns=self._turns[stage - 1],
                    max_turns=self._turns[stage],
                )
            )
        return changes

    def change_at(self, step: int) -> StageChange | None:
        """The stage change that happens exactly at ``step`` (entering it), if any."""
        if step <= 0:
            return None
        changes = self.changes_between(step - 1, step)
        return changes[0] if changes else None
