"""PPO policy loss (decoupled clip, dual-clip, aggregation), value loss, entropy, KL, log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from services.logits import processed_logprobs
from trainer.algorithms.losses import (
    aggregate_loss,
    entropy_from_logits,
    gather_logprobs,
    kl_penalty,
    logprobs_from_logits,
    next_token_entropy,
    ppo_policy_loss,
    predicting_logits,
    selected_logprobs_and_entropy,
    value_loss,
)


def one_token_loss(ratio: float, advantage: float, **kwargs) -> tuple[float, dict[str, torch.Tensor], float]:
    """Loss, stats and d loss / d logprob for a single token with the given ratio and advantage."""
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = ppo_policy_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), **kwargs
    )
    loss.backward()
    return loss.item(), stats, logprobs.grad.item()


# --- PPO clipping ---------------------------------------------------------------------------------


def test_positive_advantage_is_clipped_at_1_plus_clip_high() -> None:
    loss, stats, grad = one_token_loss(1.5, 1.0)
    # max(-1 * 1.5, -1 * clip(1.5, 0.8, 1.28)) = max(-1.5, -1.28) = -1.28, no gradient
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert stats["clipfrac"].item() == 1.0


def test_ratio_between_1_2_and_1_28_is_not_clipped_with_decoupled_clip() -> None:
    loss, stats, grad = one_token_loss(1.25, 1.0)
    assert loss == pytest.approx(-1.25)  # symmetric 0.2 clipping would give -1.2
    assert grad == pytest.approx(-1.25)  # d(-ratio)/d logp = -ratio
    assert stats["clipfrac"].item() == 0.0
    symmetric, _, _ = one_token_loss(1.25, 1.0, clip_high=0.2)
    assert symmetric == pytest.approx(-1.2)


def test_negative_advantage_is_clipped_at_1_minus_clip_low() -> None:
    loss, stats, grad = one_token_loss(0.7, -1.0)
    # max(0.7, 0.8) = 0.8, no gradient
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert stats["clipfrac"].item() == 1.0
    inside, stats_inside, grad_inside = one_token_loss(0.85, -2.0)
    assert inside == pytest.approx(1.7)  # 2 * 0.85, inside [0.8, 1.28]
    assert grad_inside == pytest.approx(1.7)
    assert stats_inside["clipfrac"].item() == 0.0


def test_clip_is_one_sided() -> None:
    # A > 0 with a low ratio and A < 0 with a high ratio keep their (pessimistic) unclipped term.
    low, _, grad_low = one_token_loss(0.5, 1.0)
    assert low == pytest.approx(-0.5) and grad_low == pytest.approx(-0.5)
    high, _, _ = one_token_loss(2.0, -1.0, dual_clip=None)
    assert high == pytest.approx(2.0)


def test_dual_clip_bounds_negative_advantage_with_a_huge_ratio() -> None:
    loss, stats, grad = one_token_loss(5.0, -1.0)
    # max(5, 1.28) = 5, then min(5, 3 * 1) = 3: constant, no gradient
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert stats["dual_clipfrac"].item() == 1.0
    below_c, stats_below, _ = one_token_loss(2.0, -1.0)
    assert below_c == pytest.approx(2.0)  # ratio under c: untouched
    assert stats_below["dual_clipfrac"].item() == 0.0
    positive, _, _ = one_token_loss(5.0, 1.0)
    assert positive == pytest.approx(-1.28)  # dual-clip never applies to A > 0


def test_policy_loss_masks_tokens_and_reports_stats() -> None:
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 100.0], [0.7, 1.0, 1.0]]))
    advantages = torch.tensor([[1.0, 2.0, 50.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = ppo_policy_loss(logprobs, torch.zeros(2, 3), advantages, mask)
    # tokens: -1.28 (clipped), -2 (ratio 1), 0.8 (clipped); the masked ratio 100 is ignored
    assert loss.item() == pytest.approx((-1.28 - 2.0 + 0.8) / 3)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 1.0 + 0.7) / 3)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    # k3: (r - 1) - log r per token: (0.5 - log 1.5), 0, (-0.3 - log 0.7)
    expected_kl = ((0.5 - math.log(1.5)) + 0.0 + (-0.3 - math.log(0.7))) / 3
    assert stats["approx_kl"].item() == pytest.approx(expected_kl, abs=1e-6)


# --- aggregation ----------------------------------------------------------------------------------


LOSS_MAT = torch.tensor([[1.0, 1.0, 1.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_token_mean_vs_seq_mean_token_mean() -> None:
    # token-mean: (1 + 1 + 1 + 4) / 4 tokens; seq-mean-token-mean: (mean 1 + mean 4) / 2 episodes
    # (the empty third row counts in neither)
    assert aggregate_loss(LOSS_MAT, AGG_MASK, "token-mean").item() == pytest.approx(1.75)
    assert aggregate_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-mean").item() == pytest.approx(2.5)
    assert aggregate_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum").item() == pytest.approx(3.5)
    with pytest.raises(ValueError):
        aggregate_loss(LOSS_MAT, AGG_MASK, "sum")  # type: ignore[arg-type]


def test_global_denominator_makes_micro_batches_add_up_to_the_full_batch() -> None:
    whole = aggregate_loss(LOSS_MAT, AGG_MASK, "token-mean")
    parts = sum(
        aggregate_loss(LOSS_MAT[i : i + 1], AGG_MASK[i : i + 1], global_denominator=4) for i in range(3)
    )
    assert parts.item() == pytest.approx(whole.item())
    seq = sum(
        aggregate_loss(LOSS_MAT[i : i + 1], AGG_MASK[i : i + 1], "seq-mean-token-mean", global_denominator=2)
        for i in range(3)
    )
    assert seq.item() == pytest.approx(2.5)


def test_policy_loss_seq_mean_option() -> None:
    logprobs = torch.zeros(2, 3)  # ratio 1 everywhere: loss = -A
    advantages = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    token, _ = ppo_policy_loss(logprobs, logprobs, advantages, mask)
    seq, _ = ppo_policy_loss(logprobs, logprobs, advantages, mask, loss_agg="seq-mean-token-mean")
    assert token.item() == pytest.approx(-7 / 4)
    assert seq.item() == pytest.approx(-5 / 2)


# --- value loss -----------------------------------------------------------------------------------


def test_value_loss_clips_the_update_around_the_old_value() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.1, 0.5]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    loss, stats = value_loss(values, old, returns, torch.ones(1, 3), clip_range=0.2)
    # token 0: unclipped (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64 -> 0.64 (clipped)
    # token 1: inside the range: (0.1-1)^2 = 0.81
    # token 2: unclipped (0.5+1)^2 = 2.25, clipped (0.2+1)^2 = 1.44 -> 2.25 (moving away: kept)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3)
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert values.grad[0, 0].item() == 0.0  # the clipped term has no gradient
    plain, _ = value_loss(values, old, returns, torch.ones(1, 3), clip_range=None)
    assert plain.item() == pytest.approx(0.5 * (0.25 + 0.81 + 2.25) / 3)


def test_value_inside_the_clip_range_never_counts_as_clipped() -> None:
    """old + clamp(V - old, -c, c) rounds to 0.07003946 here, one float32 step above V: the
    "clipped" error to R = 0 is then larger, and the old formula counted the token as clipped."""
    values = torch.tensor([[0.07003945112228394]], requires_grad=True)
    old = torch.tensor([[-0.10164343565702438]])
    assert (old + (values - old).clamp(-0.5, 0.5)).item() != values.item()
    loss, stats = value_loss(values, old, torch.zeros(1, 1), torch.ones(1, 1), clip_range=0.5)
    assert stats["vf_clipfrac"].item() == 0.0
    assert (
        loss.item() == value_loss(values, old, torch.zeros(1, 1), torch.ones(1, 1), clip_range=None)[0].item()
    )
    loss.backward()
    assert values.grad.item() == pytest.approx(values.item())


# --- entropy --------------------------------------------------------------------------------------


def test_entropy_of_uniform_is_log_vocab_and_of_one_hot_is_zero() -> None:
    assert entropy_from_logits(torch.zeros(2, 3, 7)).flatten().tolist() == pytest.approx([math.log(7)] * 6)
    one_hot = torch.tensor([0.0, -1e4, -1e4, -1e4])
    assert entropy_from_logits(one_hot).item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_of_two_token_distribution() -> None:
    # probabilities (0.75, 0.25): H = -(0.75 ln 0.75 + 0.25 ln 0.25)
    logits = torch.log(torch.tensor([0.75, 0.25]))
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert entropy_from_logits(logits).item() == pytest.approx(expected, abs=1e-6)


def test_next_token_entropy_is_aligned_with_tokens() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 2] = torch.tensor([0.0, -1e4, -1e4, -1e4])  # the last position predicts nothing
    assert next_token_entropy(logits)[0].tolist() == pytest.approx([0.0, math.log(4), math.log(4)])


# --- KL -------------------------------------------------------------------------------------------


def test_k1_and_k3_values() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    # k1 = log(0.5/0.25) = ln 2 ; log(0.25/0.5) = -ln 2
    assert kl_penalty(logprobs, ref, "k1")[0].tolist() == pytest.approx([math.log(2), -math.log(2)], abs=1e-6)
    # k3: r = p_ref / p: 0.5 -> (0.5 - 1) - ln 0.5 = ln 2 - 0.5 ; 2 -> (2 - 1) - ln 2 = 1 - ln 2
    assert kl_penalty(logprobs, ref, "k3")[0].tolist() == pytest.approx(
        [math.log(2) - 0.5, 1 - math.log(2)], abs=1e-6
    )
    assert torch.equal(kl_penalty(logprobs, ref, "low_var_kl"), kl_penalty(logprobs, ref, "k3"))
    # k2 = 0.5 * (ln 2)^2
    assert kl_penalty(logprobs, ref, "k2")[0, 0].item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)


def test_kl_is_clamped_and_zero_when_policies_match() -> None:
    logprobs = torch.tensor([[0.0, -30.0]])
    ref = torch.tensor([[0.0, 0.0]])
    k3 = kl_penalty(logprobs, ref, "k3")  # second token: exp(30) - 1 - 30, clamped
    assert k3[0, 0].item() == 0.0 and k3[0, 1].item() == 10.0
    assert kl_penalty(logprobs, ref, "k1", clamp=5.0)[0, 1].item() == -5.0
    assert kl_penalty(logprobs, ref, "k1", clamp=None)[0, 1].item() == -30.0
    with pytest.raises(ValueError):
        kl_penalty(logprobs, ref, "k4")  # type: ignore[arg-type]


# --- log-probs ------------------------------------------------------------------------------------


def test_logprobs_from_logits_matches_manual_next_token_log_softmax() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [5.0, 5.0, 5.0]]])
    tokens = torch.tensor([[2, 0, 1]])
    # token 0: nothing predicts it -> 0
    # token 1 (=0) from logits[0] = (2, 0, 0): 2 - ln(e^2 + 2)
    # token 2 (=1) from logits[1] = (0, 1, 0): 1 - ln(e + 2)
    expected = [0.0, 2 - math.log(math.e**2 + 2), 1 - math.log(math.e + 2)]
    assert logprobs_from_logits(logits, tokens)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_logprobs_from_logits_divides_by_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])
    tokens = torch.tensor([[0, 0]])
    # T = 0.5: logits (4, 0): log p(0) = 4 - ln(e^4 + 1)
    got = logprobs_from_logits(logits, tokens, temperature=0.5)[0, 1].item()
    assert got == pytest.approx(4 - math.log(math.e**4 + 1), abs=1e-6)
    # greedy (T = 0) leaves the logits unscaled, as the engine does
    greedy = logprobs_from_logits(logits, tokens, temperature=0.0)[0, 1].item()
    assert greedy == pytest.approx(2 - math.log(math.e**2 + 1), abs=1e-6)


def test_gather_logprobs_has_no_shift_and_matches_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    manual = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(gather_logprobs(logits, tokens, temperature=0.7), manual)
    shifted = logprobs_from_logits(logits, tokens, temperature=0.7)
    torch.testing.assert_close(shifted[:, 1:], gather_logprobs(logits[:, :-1], tokens[:, 1:], 0.7))


def test_logprobs_match_the_engines_processed_logprobs_at_top_p_1() -> None:
    """At top_p = 1, top_k = 0 the full-softmax log-probs equal the sampling distribution's."""
    torch.manual_seed(1)
    logits = torch.randn(1, 6, 13)
    tokens = torch.randint(0, 13, (1, 6))
    for temperature in (1.0, 0.6, 0.0):
        rows = logits[0, :-1]
        engine = processed_logprobs(
            rows,
            torch.full((5,), temperature),
            torch.ones(5),
            torch.zeros(5, dtype=torch.long),
        ).gather(1, tokens[0, 1:].unsqueeze(1))[:, 0]
        ours = logprobs_from_logits(logits, tokens, temperature)[0, 1:]
        torch.testing.assert_close(ours, engine, atol=1e-5, rtol=0)


def test_selected_logprobs_use_each_rows_own_truncation() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 5, 40)
    tokens = torch.randint(0, 40, (3, 5))
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.float32)
    temperature = torch.tensor([0.7, 1.0, 1.3])
    top_p = torch.tensor([0.8, 1.0, 0.9])
    top_k = torch.tensor([0, 10, 5])
    # Make every sampled token one the row's own cut keeps (the sampler never draws another).
    for row in range(3):
        for t in range(1, 5):
            probs = processed_logprobs(
                logits[row, t - 1 : t], temperature[row : row + 1], top_p[row : row + 1], top_k[row : row + 1]
            ).exp()
            tokens[row, t] = int(probs.argmax())
    token_logits = predicting_logits(logits, mask)
    logprobs, entropy = selected_logprobs_and_entropy(token_logits, tokens, mask, temperature, top_p, top_k)
    for row in range(3):
        rows = processed_logprobs(
            logits[row, :-1], temperature[row].expand(4), top_p[row].expand(4), top_k[row].expand(4)
        )
        expected = rows.gather(1, tokens[row, 1:, None])[:, 0] * mask[row, 1:]
        torch.testing.assert_close(logprobs[row, 1:], expected, atol=1e-6, rtol=0)
        probs = rows.exp()
        plogp = torch.where(probs > 0, probs * rows, torch.zeros_like(rows))
        torch.testing.assert_close(entropy[row, 1:], -plogp.sum(-1) * mask[row, 1:], atol=1e-5, rtol=0)
    assert logprobs[:, 0].abs().sum() == 0 and (logprobs * (1 - mask)).abs().sum() == 0


def test_a_sampled_token_outside_the_current_cut_keeps_a_finite_logprob_and_gradient() -> None:
    """After an optimizer step the sampled token can fall outside top-k: its log-prob is taken
    over the kept tokens plus itself, never -inf, so the ratio and the gradient stay finite."""
    logits = torch.tensor([[[3.0, 2.0, 1.0, -2.0], [0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    tokens = torch.tensor([[0, 3]])  # token 3 is not in the top 2 of logits[0, 0]
    mask = torch.tensor([[0.0, 1.0]])
    one = torch.ones(1)
    token_logits = predicting_logits(logits, mask)
    logprobs, entropy = selected_logprobs_and_entropy(token_logits, tokens, mask, one, one, torch.tensor([2]))
    kept = torch.tensor([3.0, 2.0, -2.0])
    assert logprobs[0, 1].item() == pytest.approx(torch.log_softmax(kept, 0)[2].item(), abs=1e-6)
    assert torch.isfinite(entropy).all()
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 2].item() == 0.0  # token 2 is cut: no gradient reaches it
