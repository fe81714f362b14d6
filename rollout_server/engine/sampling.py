"""Sampling a batch of next tokens, each row with its own temperature, top-p, top-k and random draw.

The log-prob returned for a sampled token is that of the distribution it was actually drawn from:
logits divided by the temperature, then cut by top-k and top-p and renormalised (vLLM's
``--logprobs-mode processed_logprobs``; :func:`services.logits.processed_logprobs`, which the
trainer recomputes them with). That is the behaviour log-prob PPO's ratio needs, and
it is what vLLM reports, so the trainer cannot tell the two engines apart. A greedy row
(temperature 0) takes the argmax and reports ``log_softmax(logits)`` of it, as vLLM does.

Before that, a row may ask for its logits to be changed (OpenAI's and vLLM's request fields, in
vLLM's order): ``logit_bias`` added, then the repetition penalty (vLLM's, on every token seen in
the prompt or the output), then the frequency and presence penalties (OpenAI's, on the output
so far). :func:`penalise` does it for the rows that ask; the others cost nothing. The log-prob
reported is still that of the distribution the token was drawn from, penalties included; the
trainer recomputes log-probs without them (it sees the token ids, not the request), so training
on samples drawn with penalties makes the PPO ratio inexact.

The random draw is passed in (one uniform per row) rather than drawn here: the engine draws it
from each request's own ``torch.Generator``, so a seeded request samples the same tokens whatever
else shares its batch, and this module stays a pure function of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.logits import GREEDY_BELOW, processed_logprobs

LOGIT_LIMIT = 1e30
"""Penalised logits stay within +-this: divided by the smallest temperature that is not greedy
(:data:`GREEDY_BELOW`) they are still finite in float32."""


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
    stop: tuple[str, ...] = ()  # strings that end generation once the decoded output holds one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    top_logprobs: int = 0  # how many of the most likely tokens to report at each step

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def changes_logits(self) -> bool:
        """Whether :func:`penalise` has anything to do for this row."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


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
    return draw(logits, processed_logprobs(logits, temperature, top_p, top_k), temperature, uniforms)


def draw(
    logits: torch.Tensor, logprobs: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` given each row's processed log-probs (``[rows, vocab]``), which the engine also
    reads the most likely tokens from (:func:`top_logprobs`)."""
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


def top_logprobs(logprobs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` most likely tokens of each row and their log-probs, most likely first:
    ``([rows, count] long, [rows, count] float)``; ``count`` is capped at the vocabulary."""
    values, ids = logprobs.topk(min(count, logprobs.shape[1]), dim=-1)
    return ids, values


def penalise(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """The logits the rows that asked for it sample from, in vLLM's order (a new tensor).

    logits, bias: ``[rows, vocab]`` float (``bias`` is the dense ``logit_bias``, 0 elsewhere);
    output_counts: ``[rows, vocab]`` float, how often each token was generated in the row's
    sequence so far; prompt_seen: ``[rows, vocab]`` bool, the tokens of its prompt;
    presence, frequency, repetition: ``[rows]`` float.

    ``logit_bias`` is added first. The repetition penalty (vLLM's and Hugging Face's, > 0, 1 is
    none) divides the positive logits of every token seen in the prompt or the output and
    multiplies the negative ones. Then OpenAI's: ``logits[t] -= frequency * count[t] +
    presence * (count[t] > 0)``, over the generated tokens only.
    """
    logits = logits.float() + bias
    generated = output_counts > 0
    scale = torch.where(prompt_seen | generated, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * generated
    # A repetition penalty near 0 (5e-324 is 0 in float32) divides to infinity, and infinities
    # make NaN log-probs: keep the logits finite, with room left for the temperature's division.
    return torch.nan_to_num(logits, nan=0.0, posinf=LOGIT_LIMIT, neginf=-LOGIT_LIMIT).clamp(
        -LOGIT_LIMIT, LOGIT_LIMIT
    )
