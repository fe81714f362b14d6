"""Reward placement and advantage estimators on small hand-computed episodes."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from trainer.algorithms.advantages import (
    LaterSegment,
    duplicate_shares,
    episode_scores,
    first_reply_mask,
    gae_advantages,
    group_stats,
    grpo_advantages,
    inverse_probability_advantages,
    last_trainable_index,
    normalize_group_scores,
    place_rewards,
    reinforce_plus_plus_advantages,
    reply_count,
    rloo_advantages,
)
from trainer.algorithms.registry import ADVANTAGE_ESTIMATORS, CriticValues, register_advantage
from trainer.algorithms.turn_credit import episode_turns
from trainer.config import AlgorithmConfig

# One 2-turn episode: prompt P P | reply A A | observation O O | reply A A | template token X.
#                     index       0 1         2 3               4 5         6 7                 8
TWO_TURN_MASK = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0]])


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --- reward placement ---------------------------------------------------------------------------


def test_last_trainable_index_skips_trailing_masked_tokens_and_marks_empty_rows() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0, 0, 0], [0] * 9])
    assert last_trainable_index(mask).tolist() == [7, 1, -1]


def test_outcome_reward_lands_on_last_trainable_token_not_last_token() -> None:
    rewards = place_rewards(torch.tensor([2.5]), TWO_TURN_MASK)
    expected = [0, 0, 0, 0, 0, 0, 0, 2.5, 0]
    assert_close(rewards[0], expected)


def test_per_turn_rewards_land_on_each_turns_last_trainable_token() -> None:
    # turn 1 ends at its observation's last token (5); turn 2 at the template token (8).
    rewards = place_rewards(
        torch.tensor([1.0]), TWO_TURN_MASK, turn_rewards=[[-0.1, 0.5]], turn_end_indices=[[5, 8]]
    )
    assert_close(rewards[0], [0, 0, 0, -0.1, 0, 0, 0, 1.5, 0])


def test_turn_without_trainable_token_is_an_error() -> None:
    with pytest.raises(ValueError, match="no trainable token"):
        place_rewards(torch.tensor([1.0]), TWO_TURN_MASK, turn_rewards=[[1.0]], turn_end_indices=[[1]])


def test_reward_on_masked_token_is_lost_by_gae_and_reinforce_pp_but_ours_is_not() -> None:
    """AgentGym-RL puts the outcome reward on the episode's last token, an observation/template
    token that the mask removes; GAE and REINFORCE++ only walk trainable tokens, so it vanishes."""
    mask = torch.cat([TWO_TURN_MASK, TWO_TURN_MASK])
    values = torch.zeros(2, 9)
    buggy = torch.zeros(2, 9)
    buggy[:, -1] = torch.tensor([1.0, 0.0])  # reward on the (masked) last token

    adv_buggy, _ = gae_advantages(buggy, values, mask, gamma=1.0, lam=1.0)
    assert adv_buggy.abs().sum().item() == 0.0  # the bug: the reward never reaches the policy
    _, ret_buggy = reinforce_plus_plus_advantages(buggy, mask)
    assert ret_buggy.abs().sum().item() == 0.0

    ours = place_rewards(torch.tensor([1.0, 0.0]), mask)
    adv, _ = gae_advantages(ours, values, mask, gamma=1.0, lam=1.0)
    # gamma = lam = 1, zero values: every trainable token of the winning episode gets advantage 1
    assert adv[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0]
    assert adv[1].abs().sum().item() == 0.0
    _, ret = reinforce_plus_plus_advantages(ours, mask)
    assert ret[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0]


def test_episode_scores_sum_rewards_on_trainable_tokens() -> None:
    rewards = place_rewards(
        torch.tensor([1.0]), TWO_TURN_MASK, turn_rewards=[[-0.25, 0.5]], turn_end_indices=[[3, 7]]
    )
    assert_close(episode_scores(rewards, TWO_TURN_MASK), [1.25])


# --- GAE ----------------------------------------------------------------------------------------


def test_gae_two_turn_episode_skips_observation_tokens() -> None:
    # Trainable values: v2=0.5 v3=0.4 v6=0.6 v7=0.8; masked positions hold 9.0, which must never
    # be used as a bootstrap value. Reward 1 on token 7; gamma 0.9, lam 0.8 (gamma*lam = 0.72).
    values = torch.tensor([[9.0, 9.0, 0.5, 0.4, 9.0, 9.0, 0.6, 0.8, 9.0]])
    rewards = place_rewards(torch.tensor([1.0]), TWO_TURN_MASK)
    adv, ret = gae_advantages(rewards, values, TWO_TURN_MASK, gamma=0.9, lam=0.8)
    # t=7: delta = 1 + 0.9*0 - 0.8 = 0.2                     A7 = 0.2
    # t=6: delta = 0 + 0.9*0.8 - 0.6 = 0.12                  A6 = 0.12 + 0.72*0.2   = 0.264
    # t=3: next value is v6 (first token of turn 2):
    #      delta = 0 + 0.9*0.6 - 0.4 = 0.14                  A3 = 0.14 + 0.72*0.264 = 0.33008
    # t=2: delta = 0 + 0.9*0.4 - 0.5 = -0.14                 A2 = -0.14 + 0.72*0.33008 = 0.0976576
    assert_close(adv[0], [0, 0, 0.0976576, 0.33008, 0, 0, 0.264, 0.2, 0])
    assert_close(ret[0], [0, 0, 0.5976576, 0.73008, 0, 0, 0.864, 1.0, 0])


def test_gae_rows_are_independent_and_padding_is_zero() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    values = torch.tensor([[0.0, 0.0, 5.0], [0.25, 5.0, 5.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    # row 0: A1 = 1, A0 = 0 + 0.5*0 - 0 + 0.5*1 = 0.5; row 1: A0 = 1 - 0.25 = 0.75
    assert_close(adv, [[0.5, 1.0, 0.0], [0.75, 0.0, 0.0]])
    assert_close(ret, [[0.5, 1.0, 0.0], [1.0, 0.0, 0.0]])


# --- GRPO and the normalisers -----------------------------------------------------------------


# Two groups of two: group "a" rewards (0, 0), group "b" (0, 4): a rare large payout.
SCORES = torch.tensor([0.0, 0.0, 0.0, 4.0])
GROUPS = ["a", "a", "b", "b"]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 1], [1, 1, 1]])


def test_grpo_with_std_divides_by_the_group_std() -> None:
    # group b: mean 2, unbiased std sqrt(((-2)^2 + 2^2) / 1) = sqrt(8); (0-2)/sqrt(8) = -1/sqrt(2)
    # group a: all equal -> centred 0, std 0: 0 / (0 + eps) = 0
    adv, ret = grpo_advantages(SCORES, MASK, GROUPS, norm_by_std=True)
    h = 1 / math.sqrt(2)
    assert_close(adv, [[0, 0, 0], [0, 0, 0], [0, -h, -h], [h, h, h]], atol=1e-5)
    assert torch.equal(adv, ret)


def test_grpo_without_std_only_subtracts_the_group_mean() -> None:
    adv, _ = grpo_advantages(SCORES, MASK, GROUPS, norm_by_std=False)
    assert_close(adv, [[0, 0, 0], [0, 0, 0], [0, -2, -2], [2, 2, 2]])


def test_grpo_group_of_three() -> None:
    adv, _ = grpo_advantages(torch.tensor([2.0, 4.0, 6.0]), torch.ones(3, 1), [7, 7, 7], eps=0.0)
    # mean 4, unbiased std sqrt((4 + 0 + 4) / 2) = 2
    assert_close(adv[:, 0], [-1.0, 0.0, 1.0])


def test_batch_normaliser_uses_group_mean_and_batch_std() -> None:
    # batch of scores (0, 0, 0, 4): mean 1, unbiased var (1+1+1+9)/3 = 4, std 2
    per_episode = normalize_group_scores(SCORES, GROUPS, "batch", eps=0.0)
    assert_close(per_episode, [0.0, 0.0, -1.0, 1.0])
    adv, _ = grpo_advantages(SCORES, MASK, GROUPS, norm_adv="batch", eps=0.0)
    assert_close(adv, [[0, 0, 0], [0, 0, 0], [0, -1, -1], [1, 1, 1]])


def test_norm_adv_none_and_group_match_the_norm_by_std_switch() -> None:
    none = normalize_group_scores(SCORES, GROUPS, "none")
    assert_close(none, [0.0, 0.0, -2.0, 2.0])
    adv_group, _ = grpo_advantages(SCORES, MASK, GROUPS, norm_adv="group")
    adv_std, _ = grpo_advantages(SCORES, MASK, GROUPS, norm_by_std=True)
    assert torch.equal(adv_group, adv_std)
    with pytest.raises(ValueError):
        normalize_group_scores(SCORES, GROUPS, "batchy")  # type: ignore[arg-type]


def test_group_ids_may_be_a_tensor_and_a_group_of_one_gets_zero() -> None:
    adv, _ = grpo_advantages(
        torch.tensor([3.0, 1.0, 5.0]), torch.ones(3, 2), torch.tensor([4, 9, 4]), eps=0.0
    )
    # group 4: (3, 5) mean 4 std sqrt(2) -> -/+ 1/sqrt(2); group 9: alone -> 0
    h = 1 / math.sqrt(2)
    assert_close(adv, [[-h, -h], [0, 0], [h, h]])


# --- RLOO -----------------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline() -> None:
    scores = torch.tensor([1.0, 2.0, 6.0, 5.0])
    adv, ret = rloo_advantages(
        scores, torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1]]), ["g", "g", "g", "solo"]
    )
    # 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5; a group of one -> 0
    assert_close(adv, [[-3, -3], [-1.5, 0], [0, 4.5], [0, 0]])
    assert torch.equal(adv, ret)


# --- REINFORCE++ ----------------------------------------------------------------------------------


def test_reinforce_plus_plus_discounted_returns_then_whitened() -> None:
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, -1.0, 0.0, 0.0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5, eps=0.0)
    # row 0: G3 = 1, G1 = 0.5 * G3 = 0.5 (token 2 is an observation: skipped), G0 = 0.25
    # row 1: G1 = -1, G0 = -0.5
    assert_close(ret, [[0.25, 0.5, 0.0, 1.0], [-0.5, -1.0, 0.0, 0.0]])
    # masked returns (0.25, 0.5, 1, -0.5, -1): mean 0.05,
    # unbiased var (0.2^2 + 0.45^2 + 0.95^2 + 0.55^2 + 1.05^2) / 4 = 2.55 / 4 = 0.6375
    sd = math.sqrt(0.6375)
    expected = [
        [0.2 / sd, 0.45 / sd, 0.0, 0.95 / sd],
        [-0.55 / sd, -1.05 / sd, 0.0, 0.0],
    ]
    assert_close(adv, expected, atol=1e-5)


# --- the registry ---------------------------------------------------------------------------------


def test_every_builtin_estimator_is_registered_and_runs_with_one_signature() -> None:
    config = AlgorithmConfig(advantage="gae", critic={"enabled": True})
    rewards = place_rewards(torch.tensor([1.0, 0.0]), torch.cat([TWO_TURN_MASK, TWO_TURN_MASK]))
    mask = torch.cat([TWO_TURN_MASK, TWO_TURN_MASK])
    critic = CriticValues(torch.zeros(2, 9), torch.zeros(2))
    turns = episode_turns(torch.arange(18).view(2, 9), mask)
    assert {"gae", "grpo", "rloo", "reinforce_pp", "turn_gae", "gigpo"} <= set(ADVANTAGE_ESTIMATORS)
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        values = critic if estimator.needs_critic else None
        extra = {"turns": turns} if estimator.needs_turns else {}
        advantages, returns = estimator.fn(rewards, values, mask, ["g", "g"], config, **extra)
        assert advantages.shape == returns.shape == (2, 9), name
        assert (advantages * (1 - mask)).abs().sum() == 0, name
    assert [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.needs_critic] == ["gae", "turn_gae"]
    assert [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.needs_turns] == ["turn_gae", "gigpo"]


def test_the_config_accepts_exactly_the_registered_estimators() -> None:
    with pytest.raises(ValidationError, match="unknown estimator 'ppo'; registered: gae, gigpo, grpo"):
        AlgorithmConfig(advantage="ppo")

    @register_advantage("zero_for_test")
    def zero(token_rewards, values, response_mask, group_ids, config):
        return torch.zeros_like(token_rewards), torch.zeros_like(token_rewards)

    try:
        assert AlgorithmConfig(advantage="zero_for_test").estimator.fn is zero
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("zero_for_test")(zero)
    finally:
        del ADVANTAGE_ESTIMATORS["zero_for_test"]


def test_gae_bootstraps_a_truncated_episode_from_the_value_where_it_was_cut() -> None:
    # The episode of test_gae_two_turn_episode_skips_observation_tokens, cut by max_turns: the
    # state after token 7 (where the final observation 8 was appended) is worth 0.5.
    values = torch.tensor([[9.0, 9.0, 0.5, 0.4, 9.0, 9.0, 0.6, 0.8, 9.0]])
    rewards = place_rewards(torch.tensor([1.0]), TWO_TURN_MASK)
    adv, ret = gae_advantages(rewards, values, TWO_TURN_MASK, 0.9, 0.8, bootstrap_values=torch.tensor([0.5]))
    # t=7: delta = 1 + 0.9*0.5 - 0.8 = 0.65                  A7 = 0.65
    # t=6: delta = 0 + 0.9*0.8 - 0.6 = 0.12                  A6 = 0.12 + 0.72*0.65   = 0.588
    # t=3: delta = 0 + 0.9*0.6 - 0.4 = 0.14                  A3 = 0.14 + 0.72*0.588  = 0.56336
    # t=2: delta = 0 + 0.9*0.4 - 0.5 = -0.14                 A2 = -0.14 + 0.72*0.56336 = 0.2656192
    assert_close(adv[0], [0, 0, 0.2656192, 0.56336, 0, 0, 0.588, 0.65, 0])
    assert_close(ret[0], [0, 0, 0.7656192, 0.96336, 0, 0, 1.188, 1.45, 0])
    # A bootstrap of 0 is the terminal episode.
    terminal, _ = gae_advantages(rewards, values, TWO_TURN_MASK, 0.9, 0.8, bootstrap_values=torch.zeros(1))
    assert_close(terminal[0], [0, 0, 0.0976576, 0.33008, 0, 0, 0.264, 0.2, 0])


def test_bootstrap_and_whitening_defaults_follow_the_estimator() -> None:
    gae = AlgorithmConfig(advantage="gae", critic={"enabled": True})
    assert gae.bootstraps_truncated and gae.whitens_advantages
    grpo = AlgorithmConfig(advantage="grpo")
    assert not grpo.bootstraps_truncated and not grpo.whitens_advantages
    assert not AlgorithmConfig(advantage="reinforce_pp").whitens_advantages
    off = AlgorithmConfig(
        advantage="gae", critic={"enabled": True}, bootstrap_truncated=False, whiten_advantages=False
    )
    assert not off.bootstraps_truncated and not off.whitens_advantages
    assert AlgorithmConfig(advantage="rloo", whiten_advantages=True).whitens_advantages
    with pytest.raises(ValidationError, match="no critic to bootstrap from"):
        AlgorithmConfig(advantage="grpo", bootstrap_truncated=True)


@pytest.mark.parametrize("norm_adv", ["group", "batch", "none"])
def test_a_later_segment_gets_its_episodes_advantage_and_counts_once(norm_adv: str) -> None:
    """An episode collated as two rows (an agent's rewritten history) weighs once in its group."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5])
    once = normalize_group_scores(scores, ["g", "g", "g", "h"], norm_adv)
    twice = normalize_group_scores(
        torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5]), ["g", LaterSegment("g"), "g", "g", "h"], norm_adv
    )
    expected = once.tolist()
    assert twice.tolist() == pytest.approx([expected[0], *expected])
    counted_twice = normalize_group_scores(
        torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5]), ["g", "g", "g", "g", "h"], norm_adv
    )
    assert counted_twice[0] != pytest.approx(once[0])  # what the marker prevents
    mean, _, size = group_stats(torch.tensor([1.0, 1.0, 0.0, 0.0]), ["g", LaterSegment("g"), "g", "g"])
    assert mean.tolist() == pytest.approx([1 / 3] * 4) and size.tolist() == [3.0] * 4
    rloo, _ = rloo_advantages(torch.tensor([1.0, 1.0, 0.0]), torch.ones(3, 2), ["g", LaterSegment("g"), "g"])
    assert rloo[:, 0].tolist() == pytest.approx([1.0, 1.0, -1.0])


def test_identical_episodes_of_a_group_split_one_share() -> None:
    """Rows 0, 1 and 3 are one episode sampled three times in group g; row 4 has row 0's tokens in
    another group, row 5 row 0's tokens with different padding after them, row 6 a later segment."""
    a, b = [5, 6, 7], [5, 6, 8]
    rows = [a, a, b, a, a, a, a]
    input_ids = torch.zeros(len(rows), 4, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), 4, dtype=torch.long)
    for i, tokens in enumerate(rows):
        input_ids[i, : len(tokens)] = torch.tensor(tokens)
        attention_mask[i, : len(tokens)] = 1
    input_ids[5, 3] = 99  # padding: not compared
    group_ids = ["g", "g", "g", "g", "h", "g", LaterSegment("g")]
    shares = duplicate_shares(input_ids, attention_mask, group_ids)
    assert shares.tolist() == pytest.approx([1 / 4, 1 / 4, 1.0, 1 / 4, 1.0, 1 / 4, 1.0])
    assert duplicate_shares(input_ids, attention_mask, torch.tensor([0, 0, 0, 0, 1, 0, 2])).tolist() == (
        pytest.approx([1 / 4, 1 / 4, 1.0, 1 / 4, 1.0, 1 / 4, 1.0])
    )


def test_episodes_of_several_sequences_are_compared_whole() -> None:
    """Episodes 1 and 3 are the same two sequences; episode 2 shares their first and parts after
    it, as episodes played under a history window share their first turn's sequence."""
    a, b, c = [5, 6, 7], [5, 6, 8], [5, 6, 9]
    rows = [a, b, a, c, a, b]
    input_ids = torch.tensor(rows)
    attention_mask = torch.ones_like(input_ids)
    group_ids = ["g", LaterSegment("g")] * 3
    episodes = ["e1", "e1", "e2", "e2", "e3", "e3"]
    shares = duplicate_shares(input_ids, attention_mask, group_ids, episodes)
    assert shares.tolist() == pytest.approx([1 / 2, 1 / 2, 1.0, 1.0, 1 / 2, 1 / 2])
    # Row by row, the shared first sequence would have been split three ways.
    assert duplicate_shares(input_ids, attention_mask, group_ids).tolist()[0] == pytest.approx(1 / 3)


def test_reply_count_counts_runs_of_trainable_tokens() -> None:
    mask = torch.cat([TWO_TURN_MASK, torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0, 0], [0] * 9])])
    assert reply_count(mask).tolist() == [2, 1, 0]


def test_inverse_probability_advantages_weight_and_centre_one_reply_groups() -> None:
    """Group g: four one-token replies with π_b 0.5, 0.5, 0.1, 0.02, three valid (A 0.5) and one
    invalid (A -1.5). Weights 1/π_b normalised to mean 1: 0.125, 0.125, 0.625, 3.125; weighted
    mean of A: (0.0625 + 0.0625 + 0.3125 - 4.6875) / 4 = -1.0625. Group h has a two-reply row and
    group k a later segment: both are left as they are."""
    logprobs = torch.log(torch.tensor([0.5, 0.5, 0.1, 0.02, 0.3, 0.3, 0.4, 0.4]))
    mask = torch.zeros(8, 5)
    mask[:, 3] = 1.0
    mask[4, 1] = 1.0  # row 4: a second reply before the last
    behaviour = logprobs.unsqueeze(1) * mask
    advantages = torch.tensor([0.5, 0.5, 0.5, -1.5, 1.0, -1.0, 0.7, -0.7]).unsqueeze(1) * mask
    group_ids = ["g", "g", "g", "g", "h", "h", "k", LaterSegment("k")]
    weighted, applies = inverse_probability_advantages(advantages, behaviour, mask, group_ids)
    assert torch.equal(applies, mask.bool() & torch.tensor([True] * 4 + [False] * 4).unsqueeze(1))
    assert weighted[:4, 3].tolist() == pytest.approx(
        [0.125 * 1.5625, 0.125 * 1.5625, 0.625 * 1.5625, 3.125 * -0.4375]
    )
    assert torch.equal(weighted[4:], advantages[4:])
    assert weighted[:4, :3].abs().sum() == 0 and weighted[:4, 4].abs().sum() == 0  # off the mask
    # a group's weighted advantages sum to 0: no push on every reply in proportion to its π
    assert float(weighted[:4, 3].sum()) == pytest.approx(0.0, abs=1e-6)


def test_first_reply_scope_weighs_the_first_turn_of_multi_turn_groups() -> None:
    """Group g: two-reply rows (tokens 1 and 3) whose first replies have π_b 0.5, 0.5, 0.1, 0.02,
    the same weights and advantages as the one-reply group above, so the first replies take the
    same values and the second replies keep theirs. Group h has a row of no reply: left alone.
    The one-reply scope leaves both groups alone."""
    mask = torch.zeros(6, 5)
    mask[:, 1] = mask[:, 3] = 1.0
    mask[5] = 0.0
    behaviour = torch.zeros(6, 5)
    behaviour[:, 1] = torch.log(torch.tensor([0.5, 0.5, 0.1, 0.02, 0.3, 1.0]))
    behaviour[:, 3] = torch.log(torch.tensor([0.9, 0.01, 0.5, 0.5, 0.3, 1.0]))  # not weighed
    behaviour = behaviour * mask
    advantages = torch.tensor([0.5, 0.5, 0.5, -1.5, 1.0, 0.0]).unsqueeze(1) * mask
    group_ids = ["g", "g", "g", "g", "h", "h"]
    weighted, applies = inverse_probability_advantages(
        advantages, behaviour, mask, group_ids, scope="first_reply"
    )
    assert applies[:4, 1].all() and applies.sum() == 4
    assert weighted[:4, 1].tolist() == pytest.approx(
        [0.125 * 1.5625, 0.125 * 1.5625, 0.625 * 1.5625, 3.125 * -0.4375]
    )
    assert torch.equal(weighted[:, 3], advantages[:, 3]) and torch.equal(weighted[4:], advantages[4:])
    untouched, applies = inverse_probability_advantages(advantages, behaviour, mask, group_ids)
    assert not applies.any() and torch.equal(untouched, advantages)


def test_first_reply_mask_marks_each_rows_first_run() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 1, 1, 0, 1], [0, 0, 0, 1, 1, 1], [0] * 6])
    assert first_reply_mask(mask).long().tolist() == [
        [0, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],
        [0] * 6,
    ]


def _valid_mix_after_training(weighting: str, seed: int, turns: int = 1) -> torch.Tensor:
    """A 24-token softmax policy per turn, tokens 0-3 valid, the rest invalid, token 0 likeliest at
    the start; an episode's reward is -0.5 x its share of invalid turns; 150 SGD steps on 32
    groups x 4 GRPO samples. With two turns a row is two replies with an observation token
    between them. Returns the first turn's valid tokens' probabilities relative to each other."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.zeros(turns, 24)
    logits[:, 0], logits[:, 1] = 1.0, 0.5
    logits.requires_grad_(True)
    optimizer = torch.optim.SGD([logits], lr=2.0)
    group_ids = torch.arange(32).repeat_interleave(4)
    columns = torch.arange(turns) * 2  # reply tokens; the columns between are observations
    mask = torch.zeros(128, 2 * turns - 1)
    mask[:, columns] = 1.0
    for _ in range(150):
        probs = torch.softmax(logits.detach(), 1)
        tokens = torch.stack(
            [
                torch.multinomial(probs[turn], 128, replacement=True, generator=generator)
                for turn in range(turns)
            ],
            dim=1,
        )
        scores = -0.5 * (tokens >= 4).float().mean(dim=1)
        advantages, _ = grpo_advantages(scores, mask, group_ids)
        if weighting == "shared":
            advantages = advantages * duplicate_shares(tokens, mask.long(), group_ids).unsqueeze(1)
        elif weighting in ("one_reply", "first_reply"):
            behaviour = torch.zeros_like(mask)
            behaviour[:, columns] = torch.log(probs[torch.arange(turns), tokens])
            advantages, _ = inverse_probability_advantages(
                advantages, behaviour, mask, group_ids, scope=weighting
            )
        logprobs = torch.log_softmax(logits, 1)[torch.arange(turns), tokens]
        loss = -(advantages[:, columns] * logprobs).sum(dim=1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    valid = torch.softmax(logits.detach()[0], 0)[:4]
    return valid / valid.sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_inverse_probability_keeps_equally_good_replies_in_their_ratio(seed: int) -> None:
    """The one-turn stage's drift trap in miniature: weighted per sample, or with duplicate shares,
    the likeliest valid token takes the whole valid mass (start 0.43); weighted by 1/π_b and
    centred, the four valid tokens keep a spread."""
    assert _valid_mix_after_training("shared", seed)[0] > 0.95
    assert _valid_mix_after_training("plain", seed)[0] > 0.95
    kept = _valid_mix_after_training("one_reply", seed)
    assert kept[0] < 0.7 and kept.min() > 0.05, kept


@pytest.mark.parametrize("seed", [0, 1])
def test_first_reply_scope_keeps_the_first_moves_of_multi_turn_episodes_in_their_ratio(seed: int) -> None:
    """The same trap on the first move of two-turn episodes: the one-reply scope leaves these
    groups alone and the first move drifts as unweighted; the first-reply scope weighs it."""
    assert _valid_mix_after_training("one_reply", seed, turns=2)[0] > 0.95
    kept = _valid_mix_after_training("first_reply", seed, turns=2)
    assert kept[0] < 0.7 and kept.min() > 0.05, kept
