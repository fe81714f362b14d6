"""Sampling a batch of next tokens, each row with its own temperature, top-p, top-k and random draw.

The log-prob returned for a sampled token is that of the distribution it was actually drawn from:
logits divided by the temperature, then cut by top-k and top-p and renormalised (vLLM's
``--logprobs-mode processed_logprobs``). That is the behaviour log-prob PPO's ratio needs, and
it is what vLLM reports, so the trainer cannot tell the two engines apart. A greedy row
(temperature 0) takes the argmax and reports ``log_softmax(logits)`` of it, as vLLM does.

The random draw is passed in (one uniform per row) rather than drawn here: the engine draws it
from each request's own ``torch.Generator``, so a seeded request samples the same tokens whatever
else shares its batch, and this module stays a pure function of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under this is greedy


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What one request asks of the sampler and of the stopping rules."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """``[rows, vocab]`` log-probs of each row's sampling distribution (``-inf`` where cut away).

    ``temperature``, ``top_p`` and ``top_k`` are ``[rows]``; greedy rows (temperature below
    :data:`GREEDY_BELOW`) are neither scaled nor cut. Top-k keeps every token tied with the k-th;
    top-p keeps the smallest set of most likely tokens whose mass reaches ``p`` (at least one),
    both as vLLM's ``apply_top_k_top_p`` does.
    """
    greedy = temperature < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / scale.unsqueeze(1)
    vocab = scaled.shape[1]
    k = torch.where(greedy | (top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    if bool((k < vocab).any()) or bool((p < 1.0).any()):
        scaled = _cut(scaled, k, p)
    return torch.log_softmax(scaled, dim=-1)


def _cut(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    ascending, order = logits.sort(dim=-1)
    vocab = logits.shape[1]
    kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    below_p = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1.0 - p).unsqueeze(1)
    below_p[:, -1] = False  # the most likely token always stays
    ascending = ascending.masked_fill(below_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its processed log-prob per row: ``([rows] long, [rows] float)``.

    Non-greedy rows invert their distribution's CDF at ``uniforms`` (``[rows]`` in [0, 1)),
    scaled by the row's total mass; tokens cut away have probability 0 and are never chosen.
    """
    logprobs = processed_logprobs(logits, temperature, top_p, top_k)
    probs = logprobs.exp()
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # A uniform within rounding of 1 can land past the end: take the last token still allowed.
    last_allowed = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)
    drawn = torch.minimum(drawn, last_allowed)
    greedy = temperature < GREEDY_BELOW
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
