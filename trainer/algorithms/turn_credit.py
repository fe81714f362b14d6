"""Turn-level credit assignment: an advantage per turn, not one per episode.

GRPO and RLOO give every token of an episode the same advantage, so in a failed episode the one
good move is pushed down with the bad ones, and in a won episode the detour is pushed up with the
moves that won it. The estimators here credit each turn (one assistant reply) on its own:

* :func:`turn_gae_advantages` -- GAE whose steps are turns: the critic is read at the first
  trainable token of each turn (the state the turn acts in), rewards are summed per turn, and
  ``gamma``/``lam`` discount per turn, not per token (RAGEN's bi-level GAE, its outer level; the
  tokens of a reply share their turn's advantage). With ``gamma = lam = 1`` the advantage of turn
  ``k`` is ``G_k - V(s_k)``, the reward-to-go from ``k`` less a baseline that depends only on the
  state: the REINFORCE gradient, unbiased (``tests/unit/test_turn_credit.py`` checks this exactly
  on an enumerated bandit).
* :func:`step_group_advantages` -- GiGPO's two levels without a critic: the episode's GRPO
  advantage plus a step-level one, in which the turns of a group that acted in the *same
  observation* form a sub-group and each is scored by its discounted reward-to-go relative to
  the others. Episodes from one initial state revisit the same states (FrozenLake's squares,
  Sokoban's rooms), so a state where one move led on and another into a hole compares the two
  moves directly, even when both episodes failed.

Conventions as in :mod:`trainer.algorithms.advantages` (``[B, S]`` padded episodes, ``response_mask``
1 on trainable tokens, pure functions under ``no_grad``). A *turn* is the trainable tokens between
two turn ends (``TrainBatch.turn_end_indices``; without them, each run of consecutive trainable
tokens); the *observation* a turn acted on is every token between the previous turn's last
trainable token and its first one (for the first turn, the whole prompt).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.algorithms.advantages import GroupIds, NormAdv, episode_scores, normalize_group_scores


@dataclass(frozen=True)
class EpisodeTurns:
    """Where the turns of each row of a ``[B, S]`` batch lie, and what each acted on.

    index: ``[B, S]`` long, the turn (0-based, counting turns with a trainable token) each
        trainable token belongs to; -1 off the mask.
    first: ``[B, T]`` long, the index of each turn's first trainable token; -1 past a row's turns
        (``T`` is the most turns of any row).
    count: ``[B]`` long, turns per row.
    observations: per row, per turn, the observation tokens the turn acted on (as bytes: equal
        observations compare equal).
    """

    index: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    observations: list[list[bytes]]

    @property
    def max_turns(self) -> int:
        """``T``."""
        return int(self.first.shape[1])


def episode_turns(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    turn_end_indices: Sequence[Sequence[int]] | None = None,
) -> EpisodeTurns:
    """Split each row's trainable tokens into turns (see the module docstring).

    input_ids, response_mask: ``[B, S]``. turn_end_indices: per row, each turn's last token
    index, ascending (``TrainBatch.turn_end_indices``); a trainable token belongs to the first turn
    whose end is at or after it (past the last end: the last turn). Turns without a trainable token
    are not counted: their rewards sit on an earlier turn's last token (``place_rewards``).
    """
    batch, seq_len = response_mask.shape
    if turn_end_indices is not None and len(turn_end_indices) != batch:
        raise ValueError(f"turn_end_indices has {len(turn_end_indices)} rows for a batch of {batch}")
    mask = response_mask.bool().cpu()
    tokens = input_ids.cpu()
    index = torch.full((batch, seq_len), -1, dtype=torch.long)
    firsts: list[list[int]] = []
    observations: list[list[bytes]] = []
    for row in range(batch):
        positions = torch.nonzero(mask[row]).squeeze(1).tolist()
        labels = _turn_labels(positions, None if turn_end_indices is None else list(turn_end_indices[row]))
        row_firsts: list[int] = []
        row_observations: list[bytes] = []
        previous_last, previous_label = -1, None
        for position, label in zip(positions, labels, strict=True):
            if label != previous_label:  # a new turn starts here
                row_firsts.append(position)
                row_observations.append(tokens[row, previous_last + 1 : position].numpy().tobytes())
            index[row, position] = len(row_firsts) - 1
            previous_last, previous_label = position, label
        firsts.append(row_firsts)
        observations.append(row_observations)
    max_turns = max((len(row) for row in firsts), default=0)
    first = torch.full((batch, max_turns), -1, dtype=torch.long)
    for row, row_firsts in enumerate(firsts):
        first[row, : len(row_firsts)] = torch.tensor(row_firsts, dtype=torch.long)
    device = response_mask.device
    return EpisodeTurns(
        index=index.to(device),
        first=first.to(device),
        count=torch.tensor([len(row) for row in firsts], dtype=torch.long, device=device),
        observations=observations,
    )


def _turn_labels(positions: list[int], ends: list[int] | None) -> list[int]:
    """A label per trainable position, equal within a turn: the turn's end's number, or (without
    ends) the number of the run of consecutive positions."""
    if ends is not None:
        return [
            min(bisect.bisect_left(ends, position), len(ends) - 1) if ends else 0 for position in positions
        ]
    labels, run = [], 0
    for i, position in enumerate(positions):
        if i and position != positions[i - 1] + 1:
            run += 1
        labels.append(run)
    return labels


def turn_sums(token_values: torch.Tensor, turns: EpisodeTurns) -> torch.Tensor:
    """``[B, T]``: ``token_values`` ``[B, S]`` summed over each turn's trainable tokens."""
    batch = token_values.shape[0]
    sums = torch.zeros(batch, turns.max_turns + 1, dtype=token_values.dtype, device=token_values.device)
    slot = torch.where(turns.index >= 0, turns.index, turns.max_turns)  # off-mask tokens: a spare column
    sums.scatter_add_(1, slot, token_values)
    return sums[:, : turns.max_turns]


def broadcast_turns(per_turn: torch.Tensor, turns: EpisodeTurns) -> torch.Tensor:
    """``[B, S]``: each trainable token gets its turn's value of ``per_turn`` ``[B, T]``; 0 off the mask."""
    padded = torch.cat([per_turn, per_turn.new_zeros(per_turn.shape[0], 1)], dim=1)
    slot = torch.where(turns.index >= 0, turns.index, turns.max_turns)
    return padded.gather(1, slot)


def _valid_turns(turns: EpisodeTurns) -> torch.Tensor:
    """``[B, T]`` bool: the turns each row really has."""
    return torch.arange(turns.max_turns, device=turns.count.device).unsqueeze(0) < turns.count.unsqueeze(1)


def discounted_turn_returns(turn_rewards: torch.Tensor, turns: EpisodeTurns, gamma: float) -> torch.Tensor:
    """``[B, T]`` reward-to-go per turn, ``G_k = r_k + gamma * G_{k+1}``; 0 past a row's turns."""
    valid = _valid_turns(turns)
    returns = torch.zeros_like(turn_rewards)
    running = torch.zeros(turn_rewards.shape[0], dtype=turn_rewards.dtype, device=turn_rewards.device)
    for k in reversed(range(turns.max_turns)):
        running = torch.where(valid[:, k], turn_rewards[:, k] + gamma * running, torch.zeros_like(running))
        returns[:, k] = running
    return returns


def turn_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    turns: EpisodeTurns,
    gamma: float = 1.0,
    lam: float = 1.0,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns, broadcast to each turn's tokens.

    token_level_rewards: ``[B, S]`` (:func:`~trainer.algorithms.advantages.place_rewards`);
    values: ``[B, S]`` critic values, read at each turn's first trainable token: ``V_k``, the value
    of the state turn ``k`` acts in. bootstrap_values: ``[B]``, the value after the last turn
    (0 for an episode the env ended; the critic's value where a truncated one was cut).

        r_k     = sum of the rewards on turn k's tokens
        delta_k = r_k + gamma * V_{k+1} - V_k          (V_{K} = the bootstrap)
        A_k     = delta_k + gamma * lam * A_{k+1}

    Returns ``(advantages, returns)``, ``[B, S]``, 0 off the mask: every token of turn ``k`` has
    ``A_k``, and the critic's target ``A_k + V_k`` (the turn's lambda-return), so the critic learns
    the value of turn starts, the only states the policy is credited from.
    """
    valid = _valid_turns(turns)
    rewards = turn_sums(token_level_rewards, turns)
    turn_values = values.gather(1, turns.first.clamp(min=0)) * valid
    bootstrap = (
        torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
        if bootstrap_values is None
        else bootstrap_values.to(values.dtype)
    )
    # V_{k+1} for every k: the turn values, and the bootstrap just past each row's last turn.
    next_values = torch.cat([turn_values, turn_values.new_zeros(turn_values.shape[0], 1)], dim=1)
    next_values.scatter_(1, turns.count.unsqueeze(1), bootstrap.unsqueeze(1))
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(bootstrap)
    for k in reversed(range(turns.max_turns)):
        delta = rewards[:, k] + gamma * next_values[:, k + 1] - turn_values[:, k]
        next_advantage = torch.where(
            valid[:, k], delta + gamma * lam * next_advantage, torch.zeros_like(delta)
        )
        advantages[:, k] = next_advantage
    return broadcast_turns(advantages, turns), broadcast_turns(advantages + turn_values, turns)


def step_group_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    turns: EpisodeTurns,
    gamma: float = 1.0,
    norm_adv: NormAdv = "group",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO: the episode's group-relative advantage plus a step-level one per turn.

    token_level_rewards, response_mask: ``[B, S]``; group_ids: ``[B]`` (episodes from one initial
    state); turns: :func:`episode_turns` of the batch.

        A_episode(i) = normalise(R_i within its group)                      (GRPO)
        G_{i,k}      = discounted reward-to-go from turn k of episode i (gamma per turn)
        A_step(i,k)  = normalise(G_{i,k} within {(j,l): same group, observation_{j,l} = observation_{i,k}})
        A(i,k)       = A_episode(i) + A_step(i,k)

    ``normalise`` is :func:`~trainer.algorithms.advantages.normalize_group_scores` with
    ``norm_adv``: a sub-group of one turn (a state no other turn of the group reached) gets a
    step advantage of 0, so where states never repeat this is GRPO. Returns ``(advantages,
    returns)``, ``[B, S]``, equal (no critic), 0 off the mask.
    """
    keys = list(group_ids.tolist()) if isinstance(group_ids, torch.Tensor) else list(group_ids)
    episode = normalize_group_scores(episode_scores(token_level_rewards, response_mask), keys, norm_adv, eps)
    returns = discounted_turn_returns(turn_sums(token_level_rewards, turns), turns, gamma)
    rows, columns, anchors = [], [], []
    for row, row_observations in enumerate(turns.observations):
        for turn, observation in enumerate(row_observations):
            rows.append(row)
            columns.append(turn)
            anchors.append((keys[row], observation))  # its sub-group: same group, same observation
    step = torch.zeros_like(returns)
    if rows:
        row_index = torch.tensor(rows, device=returns.device)
        column_index = torch.tensor(columns, device=returns.device)
        step[row_index, column_index] = normalize_group_scores(
            returns[row_index, column_index], anchors, norm_adv, eps
        )
    advantages = broadcast_turns(episode.unsqueeze(1) + step, turns)
    return advantages, advantages
