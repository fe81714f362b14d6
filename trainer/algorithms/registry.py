"""The advantage estimators by name: what ``algorithm.advantage`` selects (as verl's ``core_algos``).

Every estimator has one signature, :data:`AdvantageFn`::

    fn(token_rewards, values, response_mask, group_ids, config) -> (advantages, returns)

token_rewards: ``[B, S]`` from :func:`~trainer.algorithms.place_rewards` (every reward on a
    trainable token).
values: the critic's :class:`CriticValues` for an estimator registered with
    ``needs_critic=True``, None for the others.
response_mask: ``[B, S]``, 1 on trainable tokens; group_ids: ``[B]``, episodes of one initial state.
config: the run's :class:`~trainer.config.AlgorithmConfig` (``gamma``, ``lam``, ``norm_adv``, ...).
An estimator registered with ``needs_turns=True`` is also given ``turns=``, the batch's
:class:`~trainer.algorithms.turn_credit.EpisodeTurns` (where each turn lies, what it acted on).
Returns ``(advantages, returns)``, ``[B, S]``, 0 outside the mask; ``returns`` are the critic's
targets (estimators without a critic return their advantages or reward-to-go there).

Adding an estimator is one decorated function, anywhere imported before the config is loaded::

    @register_advantage("my_estimator")
    def my_estimator(token_rewards, values, response_mask, group_ids, config): ...

The trainer then builds a critic for it when ``needs_critic`` is set, the config accepts
``advantage: my_estimator``, and ``whiten_by_default`` is what ``algorithm.whiten_advantages:
null`` means for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from trainer.algorithms.advantages import (
    GroupIds,
    episode_scores,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from trainer.algorithms.turn_credit import EpisodeTurns, step_group_advantages, turn_gae_advantages

if TYPE_CHECKING:
    from trainer.config import AlgorithmConfig


class CriticValues(NamedTuple):
    """What the critic says about a batch.

    values: ``[B, S]``, V(state before token ``t``), 0 outside the response mask.
    bootstrap: ``[B]``, the value of the state after each row's last trainable token: the
        critic's value of the state a truncated episode was cut in, 0 for an episode that ended.
    """

    values: torch.Tensor
    bootstrap: torch.Tensor


AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(token_rewards, values, response_mask, group_ids, config[, *, turns]) -> (advantages, returns)``
(see the module docstring); ``turns`` only for an estimator registered with ``needs_turns``."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function and what the trainer must provide for it.

    needs_critic: the trainer trains a critic and passes its :class:`CriticValues`.
    needs_turns: the trainer splits the batch into turns and passes them as ``turns=``.
    whiten_by_default: whether its advantages are whitened when ``algorithm.whiten_advantages``
        is left unset.
    """

    name: str
    fn: AdvantageFn
    needs_critic: bool = False
    whiten_by_default: bool = False
    needs_turns: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(
    name: str, *, needs_critic: bool = False, whiten_by_default: bool = False, needs_turns: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn`` as the estimator ``name`` (a name is registered once)."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            name, fn, needs_critic, whiten_by_default, needs_turns
        )
        return fn

    return register


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ``KeyError`` naming the registered ones."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {known}") from None


# --------------------------------------------------------------------------------------------
# The built-in estimators
# --------------------------------------------------------------------------------------------


@register_advantage("gae", needs_critic=True, whiten_by_default=True)
def gae(
    token_rewards: torch.Tensor,
    values: CriticValues | None,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    config: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE over the trainable tokens (:func:`~trainer.algorithms.gae_advantages`)."""
    if values is None:
        raise ValueError("the 'gae' estimator needs the critic's values")
    return gae_advantages(
        token_rewards, values.values, response_mask, config.gamma, config.lam, values.bootstrap
    )


@register_advantage("grpo")
def grpo(
    token_rewards: torch.Tensor,
    values: CriticValues | None,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    config: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO on the episode returns, normalised per ``config.norm_adv``."""
    scores = episode_scores(token_rewards, response_mask)
    return grpo_advantages(scores, response_mask, group_ids, norm_adv=config.norm_adv)


@register_advantage("rloo")
def rloo(
    token_rewards: torch.Tensor,
    values: CriticValues | None,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    config: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: the leave-one-out group mean as each episode's baseline."""
    return rloo_advantages(episode_scores(token_rewards, response_mask), response_mask, group_ids)


@register_advantage("reinforce_pp")
def reinforce_pp(
    token_rewards: torch.Tensor,
    values: CriticValues | None,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    config: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over the batch (part of the method, so
    ``whiten_advantages`` need not repeat it)."""
    return reinforce_plus_plus_advantages(token_rewards, response_mask, config.gamma)


@register_advantage("turn_gae", needs_critic=True, whiten_by_default=True, needs_turns=True)
def turn_gae(
    token_rewards: torch.Tensor,
    values: CriticValues | None,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    config: AlgorithmConfig,
    *,
    turns: EpisodeTurns,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with turns as its steps: the critic read at turn starts, ``gamma``/``lam`` per turn
    (:func:`~trainer.algorithms.turn_credit.turn_gae_advantages`)."""
    if values is None:
        raise ValueError("the 'turn_gae' estimator needs the critic's values")
    return turn_gae_advantages(
        token_rewards, values.values, turns, config.gamma, config.lam, values.bootstrap
    )


@register_advantage("gigpo", needs_turns=True)
def gigpo(
    token_rewards: torch.Tensor,
    values: CriticValues | None,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    config: AlgorithmConfig,
    *,
    turns: EpisodeTurns,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO: the episode's GRPO advantage plus a step-level one among the group's turns that
    acted in the same observation, ``gamma`` per turn
    (:func:`~trainer.algorithms.turn_credit.step_group_advantages`)."""
    return step_group_advantages(
        token_rewards, response_mask, group_ids, turns, config.gamma, config.norm_adv
    )
