"""StarPO-S group selection by in-group reward std."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.filtering import (
    group_rewards_from_batch,
    keep_mask,
    num_groups_to_keep,
    select_groups,
)

# stds (population): a 0, b 0.5, c 0, d sqrt(3/16) = 0.433
GROUPS = {
    "a": [0.0, 0.0, 0.0, 0.0],
    "b": [0.0, 1.0, 0.0, 1.0],
    "c": [1.0, 1.0, 1.0, 1.0],
    "d": [0.0, 0.0, 0.0, 1.0],
}


def test_default_ratio_keeps_the_highest_std_group() -> None:
    result = select_groups(GROUPS)  # 0.25 * 4 = 1 group
    assert result.kept_ids == ["b"]
    assert result.kept_ratio == 0.25
    assert result.stds["d"] == pytest.approx(math.sqrt(3 / 16))


def test_std_keeps_highest_and_std_rev_keeps_lowest() -> None:
    assert select_groups(GROUPS, 0.5, "std").kept_ids == ["b", "d"]
    # a and c tie at std 0: both lowest
    assert select_groups(GROUPS, 0.5, "std_rev").kept_ids == ["a", "c"]


def test_ties_break_by_input_order() -> None:
    assert select_groups(GROUPS, 0.25, "std_rev").kept_ids == ["a"]
    flipped = {"c": GROUPS["c"], "a": GROUPS["a"], "b": GROUPS["b"]}
    assert select_groups(flipped, 0.34, "std_rev").kept_ids == ["c"]
    tied = {i: [0.0, 1.0] for i in range(6)}
    assert select_groups(tied, 0.5).kept_ids == [0, 1, 2]


def test_ratio_one_keeps_every_group_in_input_order() -> None:
    result = select_groups(GROUPS, 1.0)
    assert result.kept_ids == ["a", "b", "c", "d"]
    assert result.kept_ratio == 1.0


def test_keep_counts() -> None:
    assert num_groups_to_keep(8, 0.25) == 2
    assert num_groups_to_keep(16, 0.25) == 4
    assert num_groups_to_keep(6, 0.25) == 1  # floor(1.5)
    assert num_groups_to_keep(4, 0.1) == 1  # at least one
    assert num_groups_to_keep(100, 0.29) == 29  # not 28 from 0.29 * 100 = 28.999...
    assert num_groups_to_keep(0, 0.5) == 0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            num_groups_to_keep(4, bad)


def test_kept_ratio_and_count_on_eight_groups() -> None:
    groups = {f"g{i}": [0.0, float(i)] for i in range(8)}  # std grows with i
    result = select_groups(groups, 0.25)
    assert result.kept_ids == ["g6", "g7"]
    assert result.kept_ratio == 0.25


def test_tensor_inputs_and_batch_helpers() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 3.0, 2.0, 2.0])
    group_ids = torch.tensor([5, 5, 9, 9, 7, 7])
    groups = group_rewards_from_batch(scores, group_ids)
    assert list(groups) == [5, 9, 7]
    assert groups[9].tolist() == [0.0, 3.0]
    result = select_groups(groups, 0.34)
    assert result.kept_ids == [9]
    assert keep_mask(group_ids, result.kept_ids).tolist() == [False, False, True, True, False, False]


def test_bad_mode_and_empty_group_are_errors() -> None:
    with pytest.raises(ValueError):
        select_groups(GROUPS, 0.25, "var")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        select_groups({"x": []}, 1.0)
