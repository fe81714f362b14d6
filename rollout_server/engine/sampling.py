"""Sampling a batch of next tokens, each row with its own temperature, top-p, top-k and random draw.

The log-prob returned for a sampled token is that of the distribution it was actually drawn from:
logits divided by the temperature, then cut by top-k and top-p and renormalised (vLLM's
``--logprobs-mode processed_logprobs``; :func:`services.logits.processed_logprobs`, which the
trainer recomputes them with). That is the behaviour log-prob PPO's ratio needs, and
it is what vLLM reports, so the trainer cannot tell the two engines apart. A greedy row
(temperature 0) takes the argmax and reports ``log_softmax(logits)`` of it, as vLLM does.

The random draw is passed in (one uniform per row) rather than drawn here: the engine draws it
from each request's own ``torch.Generator``, so a seeded request samples the same tokens whatever
else shares its batch, and this module stays a pure function of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.logits import GREEDY_BELOW, processed_logprobs


@dataclass(frozen=True, slots=True)
class SequenceSampling:
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
