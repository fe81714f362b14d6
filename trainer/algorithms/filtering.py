"""StarPO-S rollout filtering: keep the groups whose rewards disagree the most.

A group is the set of episodes that start from the same initial state. A group whose episodes all
got the same reward has zero advantage under any group baseline and teaches nothing; RAGEN keeps
the ``filter_ratio`` share of groups with the highest in-group reward std (default 0.25). This
module only *selects*; refilling the batch from the queue is the controller's job.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.algorithms.advantages import GroupIds, group_index

FilterMode = Literal["std", "std_rev"]


@dataclass(frozen=True)
class FilterResult:
    """Outcome of :func:`select_groups`.

    kept_ids: the kept group ids, in input order. kept_ratio: ``len(kept_ids) / num_groups``
    (log it as ``rollout/kept_ratio``). stds: every group's reward std (population, ddof 0).
    """

    kept_ids: list[Hashable]
    kept_ratio: float
    stds: dict[Hashable, float]


def num_groups_to_keep(num_groups: int, filter_ratio: float) -> int:
    """``floor(filter_ratio * num_groups)``, at least 1 (and 0 only when there are no groups)."""
    if not 0.0 < filter_ratio <= 1.0:
        raise ValueError(f"filter_ratio must be in (0, 1], got {filter_ratio}")
    if num_groups == 0:
        return 0
    # round() first so 0.29 * 100 = 28.999999999999996 counts as 29
    return max(1, math.floor(round(filter_ratio * num_groups, 6)))


def _std(rewards: Sequence[float] | torch.Tensor) -> float:
    values = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError("a group has no rewards")
    return float(values.std(correction=0))


def select_groups(
    group_rewards: Mapping[Hashable, Sequence[float] | torch.Tensor],
    filter_ratio: float = 0.25,
    mode: FilterMode = "std",
) -> FilterResult:
    """Keep the ``filter_ratio`` share of groups by in-group reward std.

    group_rewards: group id -> that group's episode rewards (a list or a 1-D tensor).
    filter_ratio: share of groups to keep, in (0, 1]; 1.0 keeps every group (filter off, vanilla
        StarPO). The count is ``floor(filter_ratio * num_groups)``, at least one.
    mode: ``"std"`` keeps the highest std (StarPO-S), ``"std_rev"`` the lowest (the ablation).
    Ties are broken by input order (earlier first), so the result is deterministic.
    """
    if mode not in ("std", "std_rev"):
        raise ValueError(f"mode must be 'std' or 'std_rev', got {mode!r}")
    ids = list(group_rewards)
    stds = {group_id: _std(group_rewards[group_id]) for group_id in ids}
    keep = num_groups_to_keep(len(ids), filter_ratio)
    sign = -1.0 if mode == "std" else 1.0
    ranked = sorted(range(len(ids)), key=lambda i: (sign * stds[ids[i]], i))
    kept_positions = sorted(ranked[:keep])
    kept_ids = [ids[i] for i in kept_positions]
    return FilterResult(kept_ids=kept_ids, kept_ratio=keep / len(ids) if ids else 0.0, stds=stds)


def group_rewards_from_batch(scores: torch.Tensor, group_ids: GroupIds) -> dict[Hashable, torch.Tensor]:
    """Split ``scores`` ``[B]`` into ``{group id: [n_g] rewards}`` (ids in first-appearance order).
    Tensor ids become Python ints."""
    keys = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    index, _ = group_index(keys)
    first: dict[Hashable, int] = {}
    for position, key in enumerate(keys):
        first.setdefault(key, position)
    return {key: scores[index == index[position]] for key, position in first.items()}


def keep_mask(group_ids: GroupIds, kept_ids: Sequence[Hashable]) -> torch.Tensor:
    """``[B]`` bool: which episodes belong to a kept group."""
    keys = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    kept = set(kept_ids)
    return torch.tensor([key in kept for key in keys], dtype=torch.bool)
