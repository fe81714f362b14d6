"""Reward placement and advantage estimators: GAE, GRPO, RLOO, REINFORCE++.

Conventions (shared by every function here and in :mod:`trainer.algorithms.losses`):

* A batch is a padded ``[B, S]`` tensor of whole multi-turn episodes: prompt, observations and
  assistant replies, one episode per row.
* ``response_mask`` ``[B, S]`` is 1 on *trainable* tokens (the sampled assistant tokens; the
  Trajectory's ``loss_mask``) and 0 on prompt, observation, chat-template and padding tokens.
* ``token_level_rewards`` ``[B, S]`` is built by :func:`place_rewards`.
* Every estimator is a pure function returning ``(advantages, returns)``, both ``[B, S]`` and 0
  outside ``response_mask``. None of them needs gradients; call them under ``torch.no_grad()``.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from trainer.algorithms.masked import masked_whiten

NormAdv = Literal["group", "batch", "none"]
GroupIds = torch.Tensor | Sequence[Hashable]


class LaterSegment(str):
    """The group id of a row that continues an episode already in the batch.

    An agent that rewrote its history leaves a trajectory of several sequences
    (``Trajectory.segments``), collated as one row each with the episode's return. The rows after
    the first carry their group id as a ``LaterSegment``: equal to it (same group, same
    statistics handed back), but not counted in the group's mean, std and size, so an episode
    weighs once in its baseline however many sequences it took.
    """

    __slots__ = ()


def _episode_weights(group_ids: GroupIds, like: torch.Tensor) -> torch.Tensor:
    """``[B]``: 1 for a row that counts in its group's statistics, 0 for a :class:`LaterSegment`."""
    if isinstance(group_ids, torch.Tensor):
        return torch.ones_like(like, dtype=torch.float32)
    return torch.tensor(
        [0.0 if isinstance(key, LaterSegment) else 1.0 for key in group_ids], device=like.device
    )


def duplicate_shares(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    group_ids: GroupIds,
    episode_ids: Sequence[Hashable] | None = None,
) -> torch.Tensor:
    """``[B]``: ``1 / n`` for the rows of an episode whose exact tokens appear ``n`` times in its group.

    input_ids, attention_mask: ``[B, S]`` (right padding); group_ids: ``[B]``; episode_ids: ``[B]``,
    the episode each row is a sequence of (its job id), None: every row is an episode.
    Scaling each row's advantage by its share makes ``A_i ∇log π(y_i)`` count once per *distinct*
    episode ``y`` of a group instead of once per sample of it. When several replies are equally
    good (every valid first move of FrozenLake's one-turn stage), the policy
    gradient pushes each in proportion to how often it was sampled, ``π(y)(1 - π(y))``, so
    whichever move happened to be likelier grows fastest and the stage ends with an arbitrary mix.
    Counted once, the likelier reply gets the smaller push, ``1 - π(y)``, and equally good
    replies keep their spread. Padding is not compared. An episode of several sequences
    (``Trajectory.segments``) is compared whole: two episodes that share their first sequence
    and part later are distinct, as they are when played as one growing sequence, so a history
    window does not change what counts as a duplicate. Without ``episode_ids`` a
    :class:`LaterSegment` row is only the duplicate of another later segment.
    """
    keys = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    lengths = attention_mask.sum(dim=1).tolist()
    rows = input_ids.cpu()
    episodes = list(range(len(keys))) if episode_ids is None else list(episode_ids)
    sequences: dict[Hashable, list[tuple[bool, bytes]]] = {}
    groups: dict[Hashable, Hashable] = {}
    for i, (key, episode) in enumerate(zip(keys, episodes, strict=True)):
        tokens = rows[i, : int(lengths[i])].numpy().tobytes()
        sequences.setdefault(episode, []).append((isinstance(key, LaterSegment), tokens))
        groups.setdefault(episode, key)
    signatures = {episode: (groups[episode], tuple(parts)) for episode, parts in sequences.items()}
    counts = collections.Counter(signatures.values())
    return torch.tensor([1.0 / counts[signatures[episode]] for episode in episodes], device=input_ids.device)


def _reply_starts(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: the first token of each run of consecutive trainable tokens (a reply)."""
    mask = response_mask.bool()
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    return starts


def reply_count(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: how many replies each row holds, the runs of consecutive trainable tokens.

    response_mask: ``[B, S]``, 1 on trainable tokens. A multi-turn episode has one run per turn
    that sampled a token; a single-turn episode has one.
    """
    return _reply_starts(response_mask).sum(dim=1)


def first_reply_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: the trainable tokens of each row's first reply, its first run of them.

    response_mask: ``[B, S]``, 1 on trainable tokens. Every token of a one-reply row.
    """
    return response_mask.bool() & (_reply_starts(response_mask).long().cumsum(dim=1) == 1)


InverseProbabilityScope = Literal["one_reply", "first_reply"]


def inverse_probability_advantages(
    advantages: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    scope: InverseProbabilityScope = "one_reply",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [B, S], applies [B, S] bool)``: on the first reply ``y_i`` of each row of a
    group, ``A'_i = w_i (A_i - Σ_j w_j A_j / n)`` with ``w_i = n (1 / π_b(y_i)) / Σ_j (1 / π_b(y_j))``
    over the group's ``n`` rows; every other token as given. ``applies`` marks the tokens changed.

    advantages, behaviour_logprobs, response_mask: ``[B, S]`` (log π_b of each sampled token, 0
    off the mask); group_ids: ``[B]``. ``π_b(y) = exp(Σ_t behaviour_logprobs[t])`` over the
    row's first reply; a row's ``A_i`` for the centring is its mean over those tokens.
    scope: ``"one_reply"`` weighs only groups whose every row is one reply (a one-turn stage, a
    bandit); ``"first_reply"`` also the first turn of multi-turn groups, whose rows all answer
    the same first observation (a group is one start state), while their later turns, each in
    an observation of its own, keep their advantages.

    Why: when several replies earn the same reward (every valid move of FrozenLake's one-turn
    stage), ``Σ_i A_i ∇log π(y_i)`` pushes each in proportion to how often it is sampled, so the
    likeliest grows fastest and the stage ends on an arbitrary mix (:func:`duplicate_shares` evens
    that only once a reply is sampled several times a group; while replies are rare, π ~ 0.01 in
    a group of 4, the push still grows with π). Weighted by ``1 / π_b``, the expected update is
    ``Σ_y A(y) ∇log π(y)`` over the distinct replies. On a softmax, ``∇log π(y)`` is
    ``e_y - π``: the ``-π`` part moves every reply's logit in proportion to its probability by
    ``-Σ_y A(y)``, which GRPO's baseline (the mean under π) does not make zero; centred on the
    weighted mean it is (in expectation) zero, and replies with the same advantage move their
    logits alike, keeping their ratio. Measured on a 24-token softmax with 4 equally good tokens
    (SGD, 150 updates of 32 groups x 4): the valid mix went from 0.43/0.26/0.16/0.16 to
    1.00/0/0/0 unweighted or with duplicate shares, and kept 0.39-0.68 for the likeliest with
    this. The same drift set one FrozenLake run's trap later, in the 8-turn stage, on the first
    move of multi-turn episodes (Right 0.28 -> 0.90 of first moves over 70 updates while every
    group came to score alike), hence ``"first_reply"``; on a two-turn softmax it keeps the first
    move's mix (0.45-0.57 for the likeliest, 1.00 without). Through the real services it slowed
    the recipe (3 seeds: 0.5 held-out after 5.5 and 6.1 min against 3.8 and 4.8, none trapped in
    either arm): after the first climb the likeliest first move is mostly a good one, and
    evening its push delays the map-blind step along a good route (README, Performance).
    Self-normalised within the group, so a group keeps its weight in the batch and no row
    outweighs its group. Only the first reply is weighted: ``π_b`` of a whole multi-turn episode
    is a product over turns whose inverse spans orders of magnitude, and only the first
    observation is the same across a group. A group with a row of no reply or a
    :class:`LaterSegment` is left alone. Meant for short replies (one-token actions): over long
    ones the rarest sample takes nearly all of its group's weight.
    """
    device = advantages.device
    index, num_groups = group_index(group_ids, device)
    replies = reply_count(response_mask)
    eligible = replies == 1 if scope == "one_reply" else replies >= 1
    if not isinstance(group_ids, torch.Tensor):
        eligible &= torch.tensor([not isinstance(key, LaterSegment) for key in group_ids], device=device)
    others = torch.zeros(num_groups, device=device).index_add_(0, index, (~eligible).float())
    first = first_reply_mask(response_mask)
    applies = (others[index] == 0).unsqueeze(1) & first

    def per_group(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=values.dtype, device=device).index_add_(0, index, values)

    first64, advantages64 = first.double(), advantages.double()
    # 1/π_b relative to the group's likeliest first reply, so exp() cannot overflow
    surprise = -(behaviour_logprobs.double() * first64).sum(dim=1)
    least = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=device)
    least = least.scatter_reduce(0, index, surprise, reduce="amin")
    inverse = torch.exp(surprise - least[index])
    size = per_group(torch.ones_like(inverse))
    weights = inverse * size[index] / per_group(inverse)[index]  # mean 1 over the group
    row_advantage = (advantages64 * first64).sum(dim=1) / first64.sum(dim=1).clamp(min=1.0)
    centre = per_group(weights * row_advantage) / size  # Σ_j w_j A_j / Σ_j w_j
    weighted = weights.unsqueeze(1) * (advantages64 - centre[index].unsqueeze(1))
    return torch.where(applies, weighted.to(advantages.dtype), advantages), applies


# --------------------------------------------------------------------------------------------
# Reward placement
# --------------------------------------------------------------------------------------------


def last_trainable_index(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: the index of the last trainable token of each row, -1 for a row with none.

    response_mask: ``[B, S]``, 1 on trainable tokens.
    """
    mask = response_mask.bool()
    seq_len = mask.shape[1]
    from_end = mask.flip(dims=[1]).int().argmax(dim=1)  # first 1 counted from the right
    index = seq_len - 1 - from_end
    return torch.where(mask.any(dim=1), index, torch.full_like(index, -1))


def place_rewards(
    outcome_reward: torch.Tensor,
    response_mask: torch.Tensor,
    turn_rewards: Sequence[Sequence[float]] | None = None,
    turn_end_indices: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Token-level rewards ``[B, S]``: every reward sits on a *trainable* token.

    outcome_reward: ``[B]``, the episode's outcome reward; it lands on the **last trainable token**
        of the row. The row's last token is usually an observation or chat-template token, which
        the mask removes; a reward put there (as AgentGym-RL does) is invisible to GAE and
        REINFORCE++, which only walk trainable tokens, so the policy never learns from it.
    response_mask: ``[B, S]``, 1 on trainable tokens.
    turn_rewards: optional, per row a list of per-turn rewards.
    turn_end_indices: per row, the index of each turn's last token (same nesting as
        ``turn_rewards``). Each reward lands on the last trainable token at or before that index,
        i.e. the turn's last sampled token. A turn with no trainable token at or before its end
        raises ``ValueError``.

    A row without any trainable token gets no reward (it carries no gradient anyway). Rewards on
    the same token add up.
    """
    batch, seq_len = response_mask.shape
    if outcome_reward.shape != (batch,):
        raise ValueError(f"outcome_reward must be [{batch}], got {list(outcome_reward.shape)}")
    rewards = torch.zeros(batch, seq_len, dtype=torch.float32, device=response_mask.device)
    last = last_trainable_index(response_mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] += outcome_reward.to(rewards.dtype)[rows]

    if turn_rewards is None:
        return rewards
    if turn_end_indices is None or len(turn_end_indices) != batch or len(turn_rewards) != batch:
        raise ValueError("turn_rewards and turn_end_indices must both have one list per row")
    mask = response_mask.bool()
    for row, (row_rewards, row_ends) in enumerate(zip(turn_rewards, turn_end_indices, strict=True)):
        if len(row_rewards) != len(row_ends):
            raise ValueError(f"row {row}: {len(row_rewards)} turn rewards for {len(row_ends)} turn ends")
        for reward, end in zip(row_rewards, row_ends, strict=True):
            trainable = torch.nonzero(mask[row, : end + 1]).squeeze(1)
            if trainable.numel() == 0:
                raise ValueError(f"row {row}: no trainable token at or before index {end}")
            rewards[row, trainable[-1]] += float(reward)
    return rewards


def episode_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each episode's total reward (sum of its rewards on trainable tokens)."""
    return (token_level_rewards * response_mask.to(token_level_rewards.dtype)).sum(dim=1)


# --------------------------------------------------------------------------------------------
# GAE (PPO with a critic)
# --------------------------------------------------------------------------------------------


def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trainable tokens of multi-turn episodes.

    token_level_rewards: ``[B, S]`` from :func:`place_rewards`.
    values: ``[B, S]`` critic values V(s_t) of the state *before* token t is sampled.
    response_mask: ``[B, S]``, 1 on trainable tokens.
    bootstrap_values: ``[B]``, the value of the state after each row's last trainable token
        (None: all 0). 0 for an episode the environment ended; for one cut by ``max_turns`` or the
        context limit, the critic's value of the state it was cut in, so that the same state's
        value target does not change when the cap does.
    Returns ``(advantages, returns)``, ``[B, S]``, 0 outside the mask; ``returns = advantages +
    values`` are the critic's targets.

    Only trainable tokens are actions, so the walk skips everything else: the "next state" of the
    last token of one turn is the state at the first trainable token of the *next* turn, and its
    value is the value there. The observation tokens in between are the environment's transition,
    not actions: they have no advantage, no TD error, no discount step, and a value at them would
    be the critic's estimate of a state the policy never acts in. (Walking every token, as
    single-turn PPO does, would bootstrap from those unsampled states and discount over tokens the
    policy does not choose.) After the last trainable token the next value is the row's bootstrap.
    For the same reason rewards on masked tokens are ignored; :func:`place_rewards` never puts
    them there.

        delta_t = r_t + gamma * V(next trainable t') - V(t)
        A_t     = delta_t + gamma * lam * A_{t'}
    """
    mask = response_mask.to(values.dtype)
    batch, seq_len = values.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    if bootstrap_values is not None:
        next_value = bootstrap_values.to(values.dtype).clone()
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(seq_len)):
        is_action = mask[:, t] > 0
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(is_action, advantage, torch.zeros_like(advantage))
        # Masked tokens leave the carried (next value, next advantage) untouched: they are skipped.
        next_value = torch.where(is_action, values[:, t], next_value)
        next_advantage = torch.where(is_action, advantage, next_advantage)
    returns = (advantages + values) * mask
    return advantages, returns


# --------------------------------------------------------------------------------------------
# Group baselines: GRPO and RLOO
# --------------------------------------------------------------------------------------------


def group_index(group_ids: GroupIds, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map ``group_ids`` (``[B]`` tensor, or a sequence of hashable ids) to ``[B]`` long indices
    ``0..G-1`` in order of first appearance; returns ``(index, G)``."""
    keys = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    order: dict[Hashable, int] = {}
    index = [order.setdefault(key, len(order)) for key in keys]
    return torch.tensor(index, dtype=torch.long, device=device), len(order)


def group_stats(scores: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-episode statistics of its group, each ``[B]``: ``(mean, std, size)``.

    scores: ``[B]`` episode rewards. ``std`` is the unbiased (Bessel) standard deviation, 0 for a
    group of one. Rows whose group id is a :class:`LaterSegment` get their group's statistics
    but are not counted in them (their episode's first row is).
    """
    index, num_groups = group_index(group_ids, scores.device)
    scores = scores.to(torch.float32)
    weight = _episode_weights(group_ids, scores)
    size = torch.zeros(num_groups, device=scores.device).index_add_(0, index, weight)
    total = torch.zeros(num_groups, device=scores.device).index_add_(0, index, weight * scores)
    mean = total / size
    squared = torch.zeros(num_groups, device=scores.device).index_add_(
        0, index, weight * (scores - mean[index]) ** 2
    )
    std = torch.where(size > 1, (squared / (size - 1).clamp(min=1)).sqrt(), torch.zeros_like(size))
    return mean[index], std[index], size[index]


def normalize_group_scores(
    scores: torch.Tensor, group_ids: GroupIds, norm_adv: NormAdv = "group", eps: float = 1e-6
) -> torch.Tensor:
    """``[B]`` episode advantages: each score minus its group's mean, then scaled.

    scores: ``[B]`` episode rewards; group_ids: ``[B]`` (episodes from the same initial state).
    norm_adv:
      * ``"group"`` -- divide by the group's std (+ eps): GRPO as published.
      * ``"batch"`` -- divide by the std of all ``B`` scores (+ eps). With a rare large payout,
        per-group scaling inflates every group without a winner (tiny std) and shrinks the groups
        with one: the policy is pushed toward the safe action. One batch-wide scale keeps the
        advantages comparable across groups (group mean, batch std, as in "Lite PPO").
      * ``"none"`` -- mean subtraction only (Dr. GRPO; GRPO with ``norm_by_std=False``).
    A group of one has advantage 0 (it is its own baseline); so does a group (or, for
    ``"batch"``, a batch) whose scores are all equal, even with ``eps=0``.
    """
    mean, std, _ = group_stats(scores, group_ids)
    centred = scores.to(torch.float32) - mean
    if norm_adv == "none":
        return centred
    if norm_adv == "group":
        scale = std + eps
    elif norm_adv == "batch":
        counted = scores.to(torch.float32)[_episode_weights(group_ids, scores) > 0]
        batch_std = counted.std() if counted.numel() > 1 else centred.new_zeros(())
        scale = (batch_std + eps).expand_as(centred)
    else:
        raise ValueError(f"norm_adv must be 'group', 'batch' or 'none', got {norm_adv!r}")
    # A zero scale means every centred score is 0 too: the advantage is 0, not 0/0.
    return torch.where(scale > 0, centred / scale.clamp(min=torch.finfo(centred.dtype).tiny), 0.0)


def grpo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_by_std: bool = True,
    norm_adv: NormAdv | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: outcome advantages relative to the group, broadcast over every trainable token.

    scores: ``[B]`` episode rewards (outcome, or :func:`episode_scores` of the token rewards).
    response_mask: ``[B, S]``; group_ids: ``[B]``.
    norm_by_std: ``A = (R - mean_group) / (std_group + eps)`` when true, ``R - mean_group`` when
        false. ``norm_adv`` (see :func:`normalize_group_scores`), when given, overrides it.
    Returns ``(advantages, returns)``, ``[B, S]``; both are the same broadcast value (there is
    no critic, so the "return" is the advantage).
    """
    mode: NormAdv = norm_adv if norm_adv is not None else ("group" if norm_by_std else "none")
    per_episode = normalize_group_scores(scores, group_ids, mode, eps)
    advantages = per_episode.unsqueeze(1) * response_mask.to(per_episode.dtype)
    return advantages, advantages


def rloo_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each episode's baseline is the mean of the *other* episodes of its group.

    scores: ``[B]``; response_mask: ``[B, S]``; group_ids: ``[B]``.
    ``A_i = R_i - (sum_group - R_i) / (n - 1)``, broadcast over the trainable tokens; 0 for a
    group of one. Returns ``(advantages, returns)``, ``[B, S]``, equal.
    """
    mean, _, size = group_stats(scores, group_ids)
    scores = scores.to(torch.float32)
    leave_one_out = (mean * size - scores) / (size - 1).clamp(min=1)
    per_episode = torch.where(size > 1, scores - leave_one_out, torch.zeros_like(scores))
    advantages = per_episode.unsqueeze(1) * response_mask.to(per_episode.dtype)
    return advantages, advantages


# --------------------------------------------------------------------------------------------
# REINFORCE++
# --------------------------------------------------------------------------------------------


def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """``[B, S]`` reward-to-go over trainable tokens: ``G_t = r_t + gamma * G_{t'}`` with ``t'``
    the next trainable token (masked tokens are skipped, as in :func:`gae_advantages`); 0 outside
    the mask."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(token_level_rewards.shape[0], dtype=returns.dtype, device=returns.device)
    for t in reversed(range(token_level_rewards.shape[1])):
        is_action = mask[:, t] > 0
        candidate = token_level_rewards[:, t] + gamma * running
        running = torch.where(is_action, candidate, running)
        returns[:, t] = torch.where(is_action, candidate, torch.zeros_like(candidate))
    return returns


def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over every trainable token of the batch.

    token_level_rewards: ``[B, S]`` (add a per-token KL penalty here if the run uses one);
    response_mask: ``[B, S]``. Returns ``(advantages, returns)``, ``[B, S]``, 0 outside the mask;
    ``advantages = (G - mean) / sqrt(var + eps)`` with the (unbiased) batch statistics of G over
    masked tokens.
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask, eps)
    return advantages, returns
