"""The sampling distribution of a row of logits: temperature, then top-k, then top-p.

One definition shared by the engine, which samples from it and reports its log-probs (vLLM's
``--logprobs-mode processed_logprobs``), and the trainer, which recomputes the same log-probs for
the PPO ratio. If the two differed, the on-policy ratio would be the mass the truncation kept
instead of 1.

Order and rules as in vLLM's sampler: logits divided by the temperature; top-k keeps the ``k``
largest (and every token tied with the k-th); top-p then keeps the smallest set of the most likely
remaining tokens whose *renormalised* mass reaches ``p`` (always at least the most likely one).
A greedy row (temperature below :data:`GREEDY_BELOW`) is neither scaled nor cut.
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under this is greedy


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[rows, vocab]`` log-probs of each row's sampling distribution (``-inf`` where cut away).

    logits: ``[rows, vocab]``; temperature, top_p: ``[rows]`` float; top_k: ``[rows]`` long,
    0 or negative for no limit.
    keep: optional ``[rows]`` token ids never cut: the trainer passes the sampled tokens, so that
        after an optimizer step has moved the logits, a token outside the new cut still has a
        finite log-prob (its ratio stays defined). The engine kept it when it sampled it, so on
        the behaviour policy's own logits this changes nothing.
    """
    greedy = temperature < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / scale.to(logits.device, torch.float32).unsqueeze(1)
    vocab = scaled.shape[1]
    top_k = top_k.to(logits.device)
    k = torch.where(greedy | (top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    p = torch.where(greedy, torch.ones_like(top_p), top_p).to(logits.device, torch.float32)
    if bool((k < vocab).any()) or bool((p < 1.0).any()):
        cut = _cut_away(scaled, k, p)
        if keep is not None:
            cut = cut.scatter(1, keep.to(logits.device).unsqueeze(1), False)
        scaled = scaled.masked_fill(cut, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def _cut_away(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` bool: the tokens top-k (``k`` ``[rows]``) or then top-p (``p``) remove."""
    ascending, order = logits.sort(dim=-1)
    vocab = logits.shape[1]
    kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))
    below_k = ascending < kth_largest
    kept_probs = ascending.masked_fill(below_k, float("-inf")).softmax(dim=-1)
    below_p = kept_probs.cumsum(dim=-1) <= (1.0 - p).unsqueeze(1)
    below_p[:, -1] = False  # the most likely token always stays
    return torch.empty_like(below_k).scatter_(1, order, below_k | below_p)
