"""Policy, value, entropy and KL terms; log-probs from logits.

Shapes follow :mod:`trainer.algorithms.advantages`: ``[B, S]`` per-token tensors over whole
episodes, with ``response_mask`` 1 on trainable tokens. Every loss is a pure function returning a
scalar loss (to minimise) and a dict of detached scalar stats for logging.
"""

from __future__ import annotations

from typing import Literal

import torch

from services.logits import GREEDY_BELOW, processed_logprobs
from trainer.algorithms.masked import masked_mean

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: LossAgg = "token-mean",
    global_denominator: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, S]`` to a scalar over ``mask`` ``[B, S]``.

    * ``"token-mean"``: sum over all masked tokens / number of masked tokens. Every token weighs
      the same, so long episodes weigh more (DAPO, StarPO-S).
    * ``"seq-mean-token-mean"``: mean over tokens within each episode, then mean over episodes
      (with at least one masked token). Every episode weighs the same.
    * ``"seq-mean-token-sum"``: sum over tokens within each episode, mean over episodes.

    global_denominator: with gradient accumulation, pass the number of masked tokens (token-mean)
    or of episodes (seq-mean-*) in the *whole* update batch; each micro-batch then divides its sum
    by it, and the accumulated gradient equals the full-batch mean.
    """
    mask = mask.to(loss_mat.dtype)
    if loss_agg == "token-mean":
        total = (loss_mat * mask).sum()
        count = mask.sum() if global_denominator is None else loss_mat.new_tensor(float(global_denominator))
        return total / count.clamp(min=1.0)
    tokens = mask.sum(dim=1)
    per_seq = (loss_mat * mask).sum(dim=1)
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1.0)
    elif loss_agg != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    has_tokens = (tokens > 0).to(loss_mat.dtype)
    count = has_tokens.sum() if global_denominator is None else loss_mat.new_tensor(float(global_denominator))
    return (per_seq * has_tokens).sum() / count.clamp(min=1.0)


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    loss_agg: LossAgg = "token-mean",
    global_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with decoupled (asymmetric) clipping and dual-clip.

    logprobs: ``[B, S]`` log pi_theta(token) under the current policy (requires grad).
    old_logprobs: ``[B, S]`` log-probs under the policy that collected the batch (recomputed by
        the trainer with :func:`logprobs_from_logits`).
    advantages: ``[B, S]``; response_mask: ``[B, S]``.

        ratio   = exp(logprobs - old_logprobs)
        L_token = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        if A < 0 and dual_clip: L_token = min(L_token, -A * dual_clip)

    ``clip_high > clip_low`` ("clip-higher", DAPO) lets low-probability tokens with positive
    advantage grow further, which keeps entropy up. Dual-clip bounds the loss of a token with a
    negative advantage whose ratio has blown up (ratio > c), so one stale token cannot dominate.
    Symmetric clipping is ``clip_high = clip_low``; ``dual_clip=None`` turns dual-clip off.

    Returns ``(loss, stats)``; stats (detached, masked means): ``clipfrac`` (share of tokens where
    the clipped term was taken), ``dual_clipfrac``, ``approx_kl`` (k3 estimate of KL(old || new):
    ``(ratio - 1) - log ratio``), ``ratio_mean``, ``ratio_max``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logprobs - old_logprobs).clamp(min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual_clipped = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        is_dual_clipped = (advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(is_dual_clipped, bound, loss_mat)
    loss = aggregate_loss(loss_mat, response_mask, loss_agg, global_denominator)

    with torch.no_grad():
        mask = response_mask.bool()
        stats = {
            "clipfrac": masked_mean(is_clipped.float(), response_mask),
            "dual_clipfrac": masked_mean(is_dual_clipped.float(), response_mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
            "ratio_max": ratio[mask].max() if mask.any() else ratio.new_ones(()),
        }
    return loss, {name: value.detach() for name, value in stats.items()}


# --------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.2,
    loss_agg: LossAgg = "token-mean",
    global_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss ``0.5 * max((V - R)^2, (V_clipped - R)^2)``.

    values: ``[B, S]`` current critic values (requires grad); old_values: ``[B, S]`` values when
    the advantages were computed; returns: ``[B, S]`` targets from :func:`gae_advantages`;
    response_mask: ``[B, S]``. ``V_clipped = clamp(V, old - clip_range, old + clip_range)`` (as
    verl computes it): inside the range it *is* V, bit for bit, so an in-range token never counts
    as clipped (``old + clamp(V - old)`` can round one step off V); with ``clip_range=None`` the
    plain squared error. Returns ``(loss, stats)`` with ``vf_clipfrac``
    and ``vpred_mean``.
    """
    unclipped = (values - returns) ** 2
    if clip_range is None:
        loss_mat = unclipped
        is_clipped = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        clipped = (clipped_values - returns) ** 2
        loss_mat = torch.maximum(unclipped, clipped)
        is_clipped = clipped > unclipped
    loss = 0.5 * aggregate_loss(loss_mat, response_mask, loss_agg, global_denominator)
    stats = {
        "vf_clipfrac": masked_mean(is_clipped.float(), response_mask).detach(),
        "vpred_mean": masked_mean(values, response_mask).detach(),
    }
    return loss, stats


# --------------------------------------------------------------------------------------------
# Entropy, KL, log-probs
# --------------------------------------------------------------------------------------------


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature < GREEDY_BELOW or temperature == 1.0:
        return logits
    return logits / temperature


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[...]`` entropy (nats) of ``softmax(logits / temperature)`` over the last dim of
    ``logits`` ``[..., V]``: ``logsumexp(z) - sum(softmax(z) * z)``. Masked mean it with
    :func:`masked_mean` for the entropy bonus (the caller applies the coefficient, 0.001)."""
    scaled = _scaled(logits, temperature)
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)


def next_token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, S]`` entropy of the distribution each token was sampled from, aligned with the
    tokens like :func:`logprobs_from_logits`: position ``t`` gets the entropy of ``logits[:, t-1]``
    and position 0 gets 0. logits: ``[B, S, V]``."""
    entropy = entropy_from_logits(logits[:, :-1], temperature)
    return torch.cat([entropy.new_zeros(entropy.shape[0], 1), entropy], dim=1)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[...]`` log-prob of ``token_ids`` ``[...]`` under ``log_softmax(logits / T)``, where
    ``logits`` is ``[..., V]`` with the same leading shape (no shift)."""
    scaled = _scaled(logits, temperature)
    picked = scaled.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def logprobs_from_logits(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[B, S]`` log-prob of each token given the ones before it, aligned with ``token_ids``.

    logits: ``[B, S, V]``, the model's output for ``token_ids`` ``[B, S]`` (``logits[:, t]``
    predicts token ``t + 1``). Position ``t`` gets ``log_softmax(logits[:, t-1] / T)[token_t]``;
    position 0 (nothing predicts it) gets 0, and it is never trainable. ``temperature`` must be
    the sampling temperature, so the result matches the engine's processed log-probs at
    ``top_p = 1, top_k = 0``; a temperature below 1e-5 (greedy) leaves the logits unscaled, as the
    engine does.
    """
    logprobs = gather_logprobs(logits[:, :-1], token_ids[:, 1:], temperature)
    return torch.cat([logprobs.new_zeros(logprobs.shape[0], 1), logprobs], dim=1)


def selected_logprobs_and_entropy(
    token_logits: torch.Tensor,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, S]`` log-prob of each trainable token under the distribution it was sampled from, and
    that distribution's entropy; 0 off ``response_mask``. What the PPO ratio and the entropy bonus use.

    token_logits: ``[N, V]``, the logits that predict the ``N`` trainable tokens of ``input_ids``
    ``[B, S]`` (token ``t`` is predicted by column ``t - 1``), row-major: what
    :func:`trainer.shared_prefix.trainable_logits` returns, or :func:`predicting_logits` of full
    logits. Only these are ever computed: most tokens of a multi-turn episode are observations.
    temperature, top_p, top_k: ``[B]``, each row's own sampling settings. The distribution is
    :func:`services.logits.processed_logprobs`, the one the engine sampled from and reported
    (vLLM's processed log-probs), so on the behaviour policy's weights the ratio is exactly 1 at
    any top-p/top-k, not the kept mass. The sampled token always counts as kept: once an optimizer
    step has moved the logits it may fall outside the new cut, and its log-prob must stay finite.
    One ``log_softmax`` serves both results.
    """
    positions = response_mask[:, 1:].bool()
    rows = positions.nonzero()[:, 0]
    targets = input_ids[:, 1:][positions]
    log_probs = processed_logprobs(token_logits, temperature[rows], top_p[rows], top_k[rows], keep=targets)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    full_mask = torch.zeros_like(response_mask, dtype=torch.bool)
    full_mask[:, 1:] = positions
    zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=token_logits.device)
    logprobs = zeros.masked_scatter(full_mask, picked)
    entropy = None
    if with_entropy:
        finite = log_probs.masked_fill(torch.isinf(log_probs), 0.0)  # 0 * -inf would be NaN
        per_row = -(log_probs.exp() * finite).sum(dim=-1)
        entropy = zeros.masked_scatter(full_mask, per_row)
    return logprobs, entropy


def predicting_logits(logits: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[N, V]``: of full logits ``[B, S, V]``, the columns that predict the trainable tokens."""
    return logits[:, :-1][response_mask[:, 1:].bool()]


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLKind = "low_var_kl",
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """``[B, S]`` per-token estimate of KL(pi_theta || pi_ref) from sampled tokens.

    logprobs: ``[B, S]`` under the current policy; ref_logprobs: ``[B, S]`` under the reference.
    * ``"k1"``: ``logp - ref_logp`` (unbiased, high variance, can be negative).
    * ``"k2"``: ``0.5 * (logp - ref_logp)^2``.
    * ``"k3"`` / ``"low_var_kl"``: ``(r - 1) - log r`` with ``r = exp(ref_logp - logp)``
      (unbiased, never negative, low variance; Schulman's k3).
    The result is clamped to ``[-clamp, clamp]`` (``None``: no clamp). Reduce with
    :func:`aggregate_loss` and multiply by the KL coefficient (0 by default, vanilla StarPO 0.001).
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        kl = diff
    elif kind == "k2":
        kl = 0.5 * diff**2
    elif kind in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(min=-20.0, max=20.0)
        kl = torch.exp(log_ratio) - 1.0 - log_ratio
    else:
        raise ValueError(f"unknown KL kind {kind!r}")
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl
