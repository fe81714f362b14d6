"""The sampler: greedy, temperature, top-k, top-p, and log-probs of the distribution actually sampled."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_server.engine.sampling import penalise, sample, top_logprobs
from services.logits import processed_logprobs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def params(rows: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_p),
        torch.full((rows,), top_k, dtype=torch.long),
    )


def test_greedy_takes_argmax_and_reports_unscaled_log_softmax() -> None:
    tokens, logprobs = sample(LOGITS, *params(temperature=0.0, top_k=1), torch.tensor([0.99]))
    assert tokens.tolist() == [0]
    assert logprobs.item() == pytest.approx(torch.log_softmax(LOGITS, -1)[0, 0].item(), abs=1e-6)


def test_temperature_scales_the_logits() -> None:
    logprobs = processed_logprobs(LOGITS, *params(temperature=0.5))
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS / 0.5, -1), atol=1e-6)


def test_top_k_keeps_k_tokens_renormalised() -> None:
    logprobs = processed_logprobs(LOGITS, *params(top_k=2))
    assert torch.isinf(logprobs[0, 2:]).all()
    assert torch.allclose(logprobs[0, :2], torch.log_softmax(LOGITS[0, :2], -1), atol=1e-6)


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = torch.tensor([[1.0, 3.0, 1.0, 0.0]])
    kept = torch.isfinite(processed_logprobs(logits, *params(top_k=2)))
    assert kept.tolist() == [[True, True, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.softmax(LOGITS, -1)[0]
    p = (probs[0] + probs[1]).item() - 1e-3  # the top two are needed, the third is not
    logprobs = processed_logprobs(LOGITS, *params(top_p=p))
    assert torch.isfinite(logprobs[0]).tolist() == [True, True, False, False, False, False]
    assert torch.allclose(logprobs[0, :2], torch.log_softmax(LOGITS[0, :2], -1), atol=1e-6)


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logprobs = processed_logprobs(LOGITS, *params(top_p=1e-6))
    assert torch.isfinite(logprobs[0]).tolist() == [True, False, False, False, False, False]
    assert logprobs[0, 0].item() == pytest.approx(0.0, abs=1e-6)


def test_top_k_and_top_p_compose_after_temperature() -> None:
    logprobs = processed_logprobs(LOGITS, *params(temperature=2.0, top_k=3, top_p=0.999))
    expected = torch.log_softmax(LOGITS[0, :3] / 2.0, -1)
    assert torch.allclose(logprobs[0, :3], expected, atol=1e-6)
    assert torch.isinf(logprobs[0, 3:]).all()


def test_sampled_logprob_is_that_of_the_processed_distribution() -> None:
    uniforms = torch.linspace(0, 0.999, 50)
    rows = uniforms.shape[0]
    logits = LOGITS.expand(rows, -1)
    tokens, logprobs = sample(logits, *params(rows, temperature=0.7, top_k=4), uniforms)
    reference = processed_logprobs(logits, *params(rows, temperature=0.7, top_k=4))
    assert torch.equal(logprobs, reference.gather(1, tokens[:, None]).squeeze(1))
    assert set(tokens.tolist()) <= {0, 1, 2, 3}


def test_inverse_cdf_follows_the_uniform() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])  # 1/4 each
    for uniform, token in [(0.0, 0), (0.26, 1), (0.51, 2), (0.999999, 3)]:
        tokens, logprobs = sample(logits, *params(), torch.tensor([uniform]))
        assert tokens.item() == token
        assert logprobs.item() == pytest.approx(math.log(0.25), abs=1e-6)


def test_never_samples_a_token_cut_away() -> None:
    uniforms = torch.rand(2000, generator=torch.Generator().manual_seed(0))
    logits = LOGITS.expand(uniforms.shape[0], -1)
    tokens, _ = sample(logits, *params(uniforms.shape[0], top_k=2), uniforms)
    counts = torch.bincount(tokens, minlength=6)
    assert counts[2:].sum() == 0
    share = counts[0].item() / uniforms.shape[0]
    assert share == pytest.approx(torch.softmax(LOGITS[0, :2], -1)[0].item(), abs=0.04)


def test_rows_do_not_influence_each_other() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.3, 0.9])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 0, 5, 0, -1])
    uniforms = torch.tensor([0.3, 0.6, 0.9, 0.1, 0.5])
    tokens, logprobs = sample(logits, temperature, top_p, top_k, uniforms)
    for row in range(5):
        alone = slice(row, row + 1)
        token, logprob = sample(
            logits[alone], temperature[alone], top_p[alone], top_k[alone], uniforms[alone]
        )
        assert token.item() == tokens[row].item()
        assert logprob.item() == logprobs[row].item()


def test_a_uniform_next_to_one_never_picks_a_token_cut_away() -> None:
    tokens, _ = sample(LOGITS, *params(top_k=2), torch.tensor([1.0 - 1e-12]))
    assert tokens.item() == 1


def test_keep_leaves_the_named_tokens_in_the_distribution() -> None:
    logprobs = processed_logprobs(LOGITS.expand(2, -1), *params(2, top_k=2), keep=torch.tensor([4, 1]))
    assert torch.isfinite(logprobs).tolist() == [
        [True, True, False, False, True, False],
        [True, True, False, False, False, False],
    ]
    kept = LOGITS[0, [0, 1, 4]]
    assert torch.allclose(logprobs[0, [0, 1, 4]], torch.log_softmax(kept, -1), atol=1e-6)
    assert torch.equal(logprobs[1], processed_logprobs(LOGITS, *params(top_k=2))[0])


def no_penalty(rows: int, vocab: int):
    """penalise()'s arguments for ``rows`` rows that ask for nothing."""
    return (
        torch.zeros(rows, vocab),
        torch.zeros(rows, vocab, dtype=torch.bool),
        torch.zeros(rows),
        torch.zeros(rows),
        torch.ones(rows),
        torch.zeros(rows, vocab),
    )


def test_presence_and_frequency_penalties_follow_openai() -> None:
    counts, seen, presence, frequency, repetition, bias = no_penalty(1, 6)
    counts[0, 0], counts[0, 2] = 3, 1
    presence[0], frequency[0] = 0.5, 0.25
    penalised = penalise(LOGITS, counts, seen, presence, frequency, repetition, bias)
    expected = LOGITS.clone()
    expected[0, 0] -= 0.5 + 0.25 * 3
    expected[0, 2] -= 0.5 + 0.25 * 1
    assert torch.allclose(penalised, expected)
    untouched = penalise(LOGITS, *no_penalty(1, 6))
    assert torch.equal(untouched, LOGITS)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    counts, seen, presence, frequency, repetition, bias = no_penalty(1, 6)
    seen[0, 0] = True  # in the prompt
    counts[0, 4] = 1  # generated
    repetition[0] = 2.0
    penalised = penalise(LOGITS, counts, seen, presence, frequency, repetition, bias)
    expected = LOGITS.clone()
    expected[0, 0] = 2.0 / 2
    expected[0, 4] = -1.0 * 2
    assert torch.allclose(penalised, expected)


def test_logit_bias_is_added_before_the_penalties() -> None:
    counts, seen, presence, frequency, repetition, bias = no_penalty(1, 6)
    bias[0, 5], bias[0, 1] = 100.0, -100.0
    repetition[0] = 2.0
    counts[0, 5] = 1
    penalised = penalise(LOGITS, counts, seen, presence, frequency, repetition, bias)
    assert penalised[0, 5].item() == pytest.approx((-3.0 + 100.0) / 2)
    assert penalised[0, 1].item() == pytest.approx(1.0 - 100.0)
    tokens, _ = sample(penalised, *params(), torch.tensor([0.5]))
    assert tokens.item() == 5


def test_top_logprobs_are_the_most_likely_tokens_in_order() -> None:
    logprobs = processed_logprobs(LOGITS, *params(temperature=0.7))
    ids, values = top_logprobs(logprobs, 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.equal(values, logprobs[:, :3])
    ids, _ = top_logprobs(logprobs, 50)  # more than the vocabulary: all of it
    assert ids.shape == (1, 6)


def test_an_extreme_repetition_penalty_keeps_log_probs_finite() -> None:
    counts, seen, presence, frequency, repetition, bias = no_penalty(1, 6)
    seen[0, :2] = True
    repetition[0] = 5e-324  # 0 in float32
    penalised = penalise(LOGITS, counts, seen, presence, frequency, repetition, bias)
    for temperature in (0.0, 1e-5, 1.0):
        logprobs = processed_logprobs(penalised, *params(temperature=temperature, top_p=5e-324))
        assert not torch.isnan(logprobs).any()
        _, chosen = sample(penalised, *params(temperature=temperature), torch.tensor([0.7]))
        assert torch.isfinite(chosen).all()
