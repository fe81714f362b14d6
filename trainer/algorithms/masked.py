"""Masked reductions over padded ``[batch, seq]`` tensors.

Every function here takes a ``mask`` of the same shape as its input (1 on the tokens that count,
0 on prompt, observation and padding tokens) and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1, over ``dim`` (all dims when ``None``)."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 where the mask is empty (never NaN)."""
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (a scalar), with Bessel's correction when ``unbiased``."""
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    sum_sq = masked_sum((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased:
        count = count - 1.0
    return sum_sq / count.clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with mean and (unbiased) variance over the masked
    entries; 0 outside the mask.

    sum_over_ranks: sums a tensor over data-parallel ranks (e.g. an all-reduce); given, the mean
    and variance are those of the masked entries of *every* rank's batch, so N ranks whiten as one
    process holding the union would.
    """
    total = sum_over_ranks or (lambda tensor: tensor)
    mask = mask.to(values.dtype)
    sums = total(torch.stack([masked_sum(values, mask), mask.sum()]))
    count = sums[1]
    mean = sums[0] / count.clamp(min=1.0)
    sum_sq = total(masked_sum((values - mean) ** 2, mask).reshape(1))[0]
    var = sum_sq / (count - 1.0).clamp(min=1.0)
    return (values - mean) * torch.rsqrt(var + eps) * mask
