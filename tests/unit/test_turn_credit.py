"""Turn-level credit (turn_gae, gigpo): hand-computed episodes, the exact expected gradient on an
enumerated two-turn bandit, and both estimators through a real PolicyUpdater."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from synthetic import synthetic_trajectories

from deploy.model_init import init_tiny_model
from services.policy import load_policy
from services.rollout_protocol import SamplingParams
from trainer.algorithms.advantages import gae_advantages, grpo_advantages, place_rewards
from trainer.algorithms.registry import ADVANTAGE_ESTIMATORS, CriticValues
from trainer.algorithms.turn_credit import episode_turns, step_group_advantages, turn_gae_advantages
from trainer.batch import collate
from trainer.config import AlgorithmConfig, TrainConfig
from trainer.update import PolicyUpdater

# prompt P P | reply A A | observation O O | reply A A | template X
# index      0 1         2 3               4 5         6 7          8
TWO_TURN_MASK = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
TWO_TURN_IDS = torch.tensor([[5, 6, 10, 11, 7, 8, 12, 13, 9]])


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --- splitting episodes into turns ----------------------------------------------------------------


def test_turns_are_runs_of_trainable_tokens_and_observations_what_came_before() -> None:
    turns = episode_turns(TWO_TURN_IDS, TWO_TURN_MASK)
    assert turns.index[0].tolist() == [-1, -1, 0, 0, -1, -1, 1, 1, -1]
    assert turns.first.tolist() == [[2, 6]] and turns.count.tolist() == [2]
    as_ids = [torch.frombuffer(bytearray(o), dtype=torch.long).tolist() for o in turns.observations[0]]
    assert as_ids == [[5, 6], [7, 8]]  # the prompt, then the observation between the replies


def test_turn_ends_split_adjacent_replies_that_runs_would_merge() -> None:
    # Two one-token turns with no observation between them (a reply of two actions, say): the
    # trainable tokens are one run, the turn ends say they are two turns.
    mask = torch.tensor([[0, 1, 1, 0]], dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert episode_turns(ids, mask).count.tolist() == [1]
    by_ends = episode_turns(ids, mask, [[1, 3]])
    assert by_ends.index[0].tolist() == [-1, 0, 1, -1] and by_ends.count.tolist() == [2]
    assert by_ends.observations[0][1] == b""  # nothing between them


def test_rows_with_different_turn_counts_pad_with_minus_one() -> None:
    mask = torch.tensor([[0, 1, 0, 1, 0, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
    turns = episode_turns(torch.arange(12).view(2, 6), mask)
    assert turns.count.tolist() == [3, 1]
    assert turns.first.tolist() == [[1, 3, 5], [1, -1, -1]]


# --- turn-level GAE -------------------------------------------------------------------------------


def test_turn_gae_by_hand_discounts_per_turn_not_per_token() -> None:
    # Rewards: turn 1 gets -0.1, turn 2 gets 1.0. V at turn starts: 0.2 (index 2) and 0.6 (index 6);
    # the values at the turns' other tokens (9.0) must not matter.
    rewards = place_rewards(torch.tensor([0.0]), TWO_TURN_MASK, [[-0.1, 1.0]], [[3, 7]])
    values = torch.tensor([[0, 0, 0.2, 9.0, 0, 0, 0.6, 9.0, 0]])
    turns = episode_turns(TWO_TURN_IDS, TWO_TURN_MASK, [[3, 7]])
    advantages, returns = turn_gae_advantages(rewards, values, turns, gamma=0.9, lam=0.5)
    a2 = 1.0 - 0.6  # delta_2; V after the last turn is 0 (the episode ended)
    a1 = (-0.1 + 0.9 * 0.6 - 0.2) + 0.9 * 0.5 * a2
    assert_close(advantages[0], [0, 0, a1, a1, 0, 0, a2, a2, 0])
    assert_close(returns[0], [0, 0, a1 + 0.2, a1 + 0.2, 0, 0, a2 + 0.6, a2 + 0.6, 0])


def test_turn_gae_bootstraps_after_the_last_turn() -> None:
    rewards = place_rewards(torch.tensor([0.0]), TWO_TURN_MASK)
    values = torch.tensor([[0, 0, 0.2, 0, 0, 0, 0.6, 0, 0]])
    turns = episode_turns(TWO_TURN_IDS, TWO_TURN_MASK)
    advantages, _ = turn_gae_advantages(rewards, values, turns, 1.0, 1.0, torch.tensor([0.5]))
    assert_close(advantages[0, [2, 6]], [0.5 - 0.2, 0.5 - 0.6])


def test_turn_gae_with_one_token_per_turn_is_token_gae() -> None:
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 0, 0, 1, 0, 1, 0], [0, 0, 1, 0, 1, 0, 0, 0]], dtype=torch.float32)
    rewards = torch.randn(2, 8, generator=generator) * mask
    values = torch.randn(2, 8, generator=generator) * mask
    bootstrap = torch.tensor([0.3, 0.0])
    turns = episode_turns(torch.zeros(2, 8, dtype=torch.long), mask)
    ours = turn_gae_advantages(rewards, values, turns, 0.95, 0.9, bootstrap)
    theirs = gae_advantages(rewards, values, mask, 0.95, 0.9, bootstrap)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


# --- GiGPO ----------------------------------------------------------------------------------------


def test_gigpo_compares_turns_that_acted_in_the_same_observation() -> None:
    # One group of three two-turn episodes (prompt 1, reply, observation, reply). Episodes 0 and 1
    # reach observation 7 and there move differently: 0 wins (reward 1 on its second turn), 1 does
    # not. Episode 2 reaches observation 8 alone. Mean-only normalisation keeps the arithmetic plain.
    ids = torch.tensor([[1, 2, 7, 3], [1, 2, 7, 4], [1, 3, 8, 3]])
    mask = torch.tensor([[0, 1, 0, 1]] * 3, dtype=torch.float32)
    rewards = place_rewards(torch.tensor([1.0, 0.0, 0.0]), mask)
    turns = episode_turns(ids, mask)
    advantages, returns = step_group_advantages(rewards, mask, ["g"] * 3, turns, gamma=0.5, norm_adv="none")
    episode = [1 - 1 / 3, -1 / 3, -1 / 3]  # GRPO, mean only
    # First turns: all three acted on the prompt; their discounted returns 0.5, 0, 0.
    first = [0.5 - 0.5 / 3, -0.5 / 3, -0.5 / 3]
    # Second turns: 0 and 1 share observation 7 (returns 1 and 0); 2 is alone (step advantage 0).
    second = [0.5, -0.5, 0.0]
    for row in range(3):
        assert_close(advantages[row], [0, episode[row] + first[row], 0, episode[row] + second[row]])
    assert torch.equal(advantages, returns)


def test_gigpo_without_repeated_states_is_grpo_plus_the_first_turn_comparison() -> None:
    # Observations all differ after the first turn: only the first turns form a sub-group.
    ids = torch.tensor([[1, 2, 7, 3], [1, 2, 8, 4]])
    mask = torch.tensor([[0, 1, 0, 1]] * 2, dtype=torch.float32)
    rewards = place_rewards(torch.tensor([1.0, 0.0]), mask)
    advantages, _ = step_group_advantages(rewards, mask, ["g", "g"], episode_turns(ids, mask), 1.0, "group")
    grpo, _ = grpo_advantages(torch.tensor([1.0, 0.0]), mask, ["g", "g"])
    torch.testing.assert_close(advantages[:, 3], grpo[:, 3])  # second turns: the episode's alone
    torch.testing.assert_close(advantages[:, 1], 2 * grpo[:, 1])  # first turns: plus the same again


# --- the expected gradient on an enumerated two-turn bandit ---------------------------------------

# Two turns, two arms each. The second turn's observation is the first arm (so the state at turn 2
# is a1); the per-turn rewards are r1(a1) and r2(a1, a2). The policy is tabular: logits theta1 [2]
# for turn 1 and theta2 [2, 2] (row a1) for turn 2.
R1 = torch.tensor([0.3, -0.2])
R2 = torch.tensor([[1.0, 0.0], [0.2, 0.9]])
EPISODE_IDS = {(a1, a2): torch.tensor([[0, 10 + a1, 20 + a1, 10 + a2]]) for a1 in (0, 1) for a2 in (0, 1)}
EPISODE_MASK = torch.tensor([[0, 1, 0, 1]], dtype=torch.float32)


def _policy() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, generator=generator).requires_grad_(),
        torch.randn(2, 2, generator=generator).requires_grad_(),
    )


def _true_gradient(theta1: torch.Tensor, theta2: torch.Tensor) -> torch.Tensor:
    """d/dtheta of J = E[r1 + r2], by enumerating the four episodes."""
    p1, p2 = theta1.softmax(0), theta2.softmax(1)
    objective = sum(
        p1[a1] * p2[a1, a2] * (R1[a1] + R2[a1, a2]) for a1, a2 in itertools.product((0, 1), (0, 1))
    )
    return torch.cat([g.flatten() for g in torch.autograd.grad(objective, [theta1, theta2])])


def _expected_estimator_gradient(theta1, theta2, advantages_of) -> torch.Tensor:
    """sum over episodes of p(episode) * sum_k A_k * grad log pi(a_k | s_k), with A from ``advantages_of``."""
    p1, p2 = theta1.softmax(0).detach(), theta2.softmax(1).detach()
    total = torch.zeros(6)
    for a1, a2 in itertools.product((0, 1), (0, 1)):
        advantages = advantages_of(a1, a2)  # [S]: A on tokens 1 and 3
        log_prob_1 = theta1.log_softmax(0)[a1]
        log_prob_2 = theta2.log_softmax(1)[a1, a2]
        surrogate = advantages[1] * log_prob_1 + advantages[3] * log_prob_2
        grads = torch.autograd.grad(surrogate, [theta1, theta2])
        total += p1[a1] * p2[a1, a2] * torch.cat([g.flatten() for g in grads])
    return total


def _turn_gae(a1: int, a2: int, v1: float, v2: list[float], lam: float) -> torch.Tensor:
    rewards = place_rewards(torch.tensor([0.0]), EPISODE_MASK, [[R1[a1].item(), R2[a1, a2].item()]], [[1, 3]])
    values = torch.tensor([[0.0, v1, 0.0, v2[a1]]])  # V(s1) and V(s2 = a1), any numbers
    turns = episode_turns(EPISODE_IDS[a1, a2], EPISODE_MASK, [[1, 3]])
    return turn_gae_advantages(rewards, values, turns, gamma=1.0, lam=lam)[0][0]


def test_turn_gae_at_lambda_one_has_the_trajectory_level_expected_gradient_with_any_critic() -> None:
    theta1, theta2 = _policy()
    true = _true_gradient(theta1, theta2)
    # Trajectory level: every turn gets the episode's return.
    trajectory = _expected_estimator_gradient(
        theta1, theta2, lambda a1, a2: torch.full((4,), float(R1[a1] + R2[a1, a2]))
    )
    torch.testing.assert_close(trajectory, true)
    # Turn level with an arbitrary state-dependent critic: the baseline cancels in expectation.
    turn_level = _expected_estimator_gradient(
        theta1, theta2, lambda a1, a2: _turn_gae(a1, a2, v1=0.7, v2=[-1.3, 2.1], lam=1.0)
    )
    torch.testing.assert_close(turn_level, true)


def test_turn_gae_below_lambda_one_is_biased_by_a_wrong_critic() -> None:
    # The check above can fail: with lam < 1 the advantage leans on V(s2), and a wrong V biases it.
    theta1, theta2 = _policy()
    biased = _expected_estimator_gradient(
        theta1, theta2, lambda a1, a2: _turn_gae(a1, a2, v1=0.7, v2=[-1.3, 2.1], lam=0.0)
    )
    assert (biased - _true_gradient(theta1, theta2)).abs().max() > 0.05


# --- through the registry and a real update -------------------------------------------------------


def test_turn_estimators_are_registered_with_what_they_need() -> None:
    assert ADVANTAGE_ESTIMATORS["turn_gae"].needs_critic and ADVANTAGE_ESTIMATORS["turn_gae"].needs_turns
    assert ADVANTAGE_ESTIMATORS["gigpo"].needs_turns and not ADVANTAGE_ESTIMATORS["gigpo"].needs_critic
    with pytest.raises(ValueError, match="needs a critic"):
        AlgorithmConfig(advantage="turn_gae")
    rewards = place_rewards(torch.tensor([1.0]), TWO_TURN_MASK)
    turns = episode_turns(TWO_TURN_IDS, TWO_TURN_MASK)
    config = AlgorithmConfig(advantage="turn_gae", critic={"enabled": True})
    critic = CriticValues(torch.zeros(1, 9), torch.zeros(1))
    advantages, _ = ADVANTAGE_ESTIMATORS["turn_gae"].fn(
        rewards, critic, TWO_TURN_MASK, ["g"], config, turns=turns
    )
    assert_close(advantages[0], [0, 0, 1, 1, 0, 0, 1, 1, 0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", 0, ["game/frozenlake"], 10, 5)


@pytest.mark.parametrize(
    "algorithm",
    [{"advantage": "gigpo"}, {"advantage": "turn_gae", "critic": {"enabled": True}, "gamma": 0.9}],
    ids=["gigpo", "turn_gae"],
)
def test_a_real_update_credits_the_turns_of_one_episode_differently(model_dir: Path, algorithm: dict) -> None:
    model, tokenizer = load_policy(model_dir)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    trajectories = synthetic_trajectories(
        model,
        groups=3,
        group_size=4,
        vocab_ids=vocab,
        first_prompt_len=12,
        observation_len=5,
        turns=(2, 4),
        sampling=SamplingParams(max_tokens=2),
        seed=1,
    )
    batch = collate(trajectories, tokenizer.pad_token_id)
    config = TrainConfig.from_dict({"algorithm": algorithm, "optim": {"lr": 1e-3, "weight_decay": 0.0}})
    updater = PolicyUpdater(model, config)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = updater.update(batch)
    assert torch.isfinite(torch.tensor(metrics["train/pg_loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    advantages = updater.last_advantages
    assert advantages is not None
    turns = episode_turns(batch.input_ids, batch.response_mask, batch.turn_end_indices)
    # Some episode's turns got different advantages: the credit is per turn, not per episode.
    per_turn = [
        {
            round(float(advantages[row, position]), 5)
            for position in turns.first[row, : turns.count[row]].tolist()
        }
        for row in range(batch.size)
    ]
    assert any(len(values) > 1 for values in per_turn)
