"""RL algorithms as pure functions of tensors: advantages, losses, StarPO-S filtering,
ScalingInter-RL schedules and the echo-trap watch. See docs/architecture.md ("Training")."""

from trainer.algorithms.advantages import (
    duplicate_shares,
    episode_scores,
    gae_advantages,
    group_stats,
    grpo_advantages,
    inverse_probability_advantages,
    last_trainable_index,
    normalize_group_scores,
    place_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from trainer.algorithms.curriculum import HorizonSchedule, StageChange
from trainer.algorithms.echo_trap import EchoTrapConfig, EchoTrapDetector, EchoTrapEvent
from trainer.algorithms.filtering import FilterResult, group_rewards_from_batch, keep_mask, select_groups
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
from trainer.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from trainer.algorithms.turn_credit import (
    EpisodeTurns,
    episode_turns,
    step_group_advantages,
    turn_gae_advantages,
)

__all__ = [
    "EchoTrapConfig",
    "EchoTrapDetector",
    "EchoTrapEvent",
    "EpisodeTurns",
    "FilterResult",
    "HorizonSchedule",
    "StageChange",
    "aggregate_loss",
    "duplicate_shares",
    "entropy_from_logits",
    "episode_scores",
    "episode_turns",
    "gae_advantages",
    "gather_logprobs",
    "group_rewards_from_batch",
    "group_stats",
    "grpo_advantages",
    "inverse_probability_advantages",
    "keep_mask",
    "kl_penalty",
    "last_trainable_index",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_token_entropy",
    "normalize_group_scores",
    "place_rewards",
    "ppo_policy_loss",
    "predicting_logits",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "select_groups",
    "selected_logprobs_and_entropy",
    "step_group_advantages",
    "turn_gae_advantages",
    "value_loss",
]
