"""The policy (and critic) update step: one :meth:`PolicyUpdater.update` per collated batch.

Read top to bottom, one update is:

1. Micro-batches (:func:`trainer.batch.micro_batches`) of at most ``optim.micro_batch_tokens``
   padded tokens. Every loss divides its micro-batch *sum* by the token (or episode) count of the
   whole batch (``global_denominator``), so the gradients accumulated over micro-batches are the
   gradient of the full-batch loss.
2. Advantages under ``no_grad``: token rewards by :func:`~trainer.algorithms.place_rewards` (per
   turn when the batch has its turn structure, else the episode return on the last trainable
   token), then the estimator ``algorithm.advantage`` names in
   :data:`~trainer.algorithms.registry.ADVANTAGE_ESTIMATORS` (with the critic's values when it
   needs them), whitened over the batch's trainable tokens when ``algorithm.whiten_advantages``
   (default on for GAE). With ``kl_coef > 0`` the reference policy's log-probs are computed here too.
3. ``ppo_epochs`` passes over the micro-batches, one optimizer step per pass: PPO loss with
   decoupled and dual clipping against the **behaviour** log-probs (docs/architecture.md, "Weights"), minus
   the entropy bonus, plus ``kl_coef`` x KL(pi || pi_ref); gradient clipping; AdamW step. The
   critic takes its own step per pass on the clipped value loss. The LR schedule advances once
   per update. With no entropy bonus and no KL term, rows whose advantage is 0 everywhere (a
   group whose episodes all scored alike) skip the policy's passes: their gradient is exactly 0.

Old log-probs. The trainer recomputes the log-probs of the sampled tokens with its current weights
under each trajectory's own sampling (temperature, top-k, top-p: the distribution the engine
sampled from and reported, :func:`~trainer.algorithms.selected_logprobs_and_entropy`) and logs
``rollout/logprob_gap`` = mean |recomputed - behaviour| over the trainable tokens of the rows it
trains on (engine/trainer mismatch, stale weights; ~0 on-policy). No extra forward pass is spent on
it: the first pass runs every micro-batch before the first optimizer step, so its log-probs
*are* the current weights' log-probs, detached. (Exact for models without dropout, which RL
fine-tuning turns off; the tiny model and Qwen2 have none.)

Distributed. When ``torch.distributed`` is initialised with ``world_size > 1`` the policy (and the
critic) are wrapped by :class:`trainer.distributed.Parallelism` (FSDP2 by default, or DDP). Each
rank updates on its own batch of whole groups (GRPO/RLOO baselines and REINFORCE++'s whitening
are per rank; ``whiten_advantages`` uses the statistics of all ranks). The token count is summed
across ranks so the averaged gradient is the token mean of the global batch, and ranks with fewer
micro-batches run zero-weight ones (and extra critic forwards) so every rank issues the same
collectives. Metrics are averaged over ranks. :meth:`checkpoint_parts`, :meth:`gathered_policy`
and :meth:`full_policy_state_dict` are collectives there: call them on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.algorithms import (
    aggregate_loss,
    duplicate_shares,
    episode_turns,
    inverse_probability_advantages,
    kl_penalty,
    masked_whiten,
    place_rewards,
    ppo_policy_loss,
    selected_logprobs_and_entropy,
    value_loss,
)
from trainer.algorithms.registry import CriticValues
from trainer.batch import TrainBatch, micro_batches
from trainer.config import TrainConfig
from trainer.critic import ValueModel
from trainer.distributed import Parallel, Parallelism
from trainer.shared_prefix import trainable_logits

STATE_FORMAT = 1


def computes_bf16_natively(device: torch.device) -> bool:
    """Whether ``optim.bf16: auto`` autocasts the forwards to bfloat16 on ``device``: on a GPU, and
    on a CPU with AMX tiles (Intel Sapphire Rapids and later), where oneDNN's matmuls and the CPU
    flash attention run bf16 in hardware. The demo's update (32k tokens, one thread) runs 1.24x
    the float32 update's tokens/s there (bench/trainer.py), with recomputed log-probs within 4e-4
    of the float32 engine's; live, where the rollout side shares the two cores, updates took 6-9%
    less time and runs made 4% more of them (bench/results/learning-bf16.json). Other CPUs keep
    float32: bf16 there is converted in software, and no measurement here says it pays.
    """
    if device.type == "cuda":
        return True
    amx_tiles = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch's own cpuinfo probe
    return device.type == "cpu" and amx_tiles is not None and bool(amx_tiles())


# --------------------------------------------------------------------------------------------
# Checkpoint glue
# --------------------------------------------------------------------------------------------


@dataclass
class _StatePart:
    """A ``HasState`` for :class:`trainer.checkpoint.CheckpointStore`: ``state_dict`` returns a
    snapshot taken when the part was made; ``load_state_dict`` restores into the live updater."""

    snapshot: dict[str, Any] | None
    loader: Any

    def state_dict(self) -> dict[str, Any]:
        if self.snapshot is None:
            raise RuntimeError("this part was made for loading only")
        return self.snapshot

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.loader(state)


# --------------------------------------------------------------------------------------------
# The updater
# --------------------------------------------------------------------------------------------


def _lr_multiplier(step: int, warmup: int, schedule: str, total: int) -> float:
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class PolicyUpdater:
    """Owns the optimisation of a policy (and of its critic, for GAE); see the module doc.

    model: a Hugging Face causal LM (``logits`` output); moved to ``device`` (default: where its
        parameters are). Under ``torch.distributed`` with ``world_size > 1`` it is wrapped in
        place (``parallel``: ``"fsdp"``, the default, or ``"ddp"``).
    config: the run's :class:`TrainConfig` (``optim``, ``algorithm``).
    reference_model: the frozen policy for the KL term; with ``kl_coef > 0`` and none given, a
        frozen copy of ``model`` as it is now.
    critic: a :class:`ValueModel` to use; by default, for ``advantage: gae``, one loaded from
        ``algorithm.critic.path`` or (None) copied from the policy's backbone.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        device: torch.device | str | None = None,
        reference_model: nn.Module | None = None,
        critic: ValueModel | None = None,
        parallel: Parallel = "fsdp",
    ) -> None:
        self.config = config
        self.optim_config = config.optim
        self.algo = config.algorithm
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.parallelism = Parallelism.current(parallel, self.device)
        bf16 = self.optim_config.bf16
        self.autocast = computes_bf16_natively(self.device) if bf16 == "auto" else bool(bf16)
        self.last_advantages: torch.Tensor | None = None
        """``[B, S]`` advantages of the last :meth:`update`'s rows (0 off the response mask), on the
        CPU: the dashboard's token view shows them next to the tokens they were applied to."""

        model.to(self.device)
        if self.optim_config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()

        # The reference and the critic are made from the plain model, before it is wrapped.
        self.reference_model: nn.Module | None = None
        if self.algo.kl_coef > 0 or reference_model is not None:
            reference = reference_model if reference_model is not None else copy.deepcopy(model)
            reference.to(self.device).eval().requires_grad_(False)
            self.reference_model = reference
        self.critic: nn.Module | None = None
        self.estimator = self.algo.estimator
        if critic is None and self.estimator.needs_critic:
            path = self.algo.critic.path
            critic = ValueModel.from_pretrained(path) if path else ValueModel.from_policy(model)
        if critic is not None:
            critic.to(self.device).train()
            if self.optim_config.gradient_checkpointing and hasattr(
                critic.backbone, "gradient_checkpointing_enable"
            ):
                critic.backbone.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.model = self.parallelism.wrap(model)
        self.critic = self.parallelism.wrap(critic) if critic is not None else None

        self.optimizer = self._make_optimizer(self.model, self.optim_config.lr)
        self.scheduler = self._make_scheduler(self.optimizer)
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if self.critic is not None:
            self.critic_optimizer = self._make_optimizer(self.critic, self.algo.critic.lr)
            self.critic_scheduler = self._make_scheduler(self.critic_optimizer)
        self.step = 0

    # -- construction --

    def _make_optimizer(self, module: nn.Module, lr: float) -> torch.optim.Optimizer:
        params = [p for p in module.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params,
            lr=lr,
            betas=tuple(self.optim_config.betas),
            weight_decay=self.optim_config.weight_decay,
            foreach=True,
        )

    def _make_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        warmup = self.optim_config.warmup_steps
        schedule = self.optim_config.schedule
        total = self.optim_config.total_steps
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: _lr_multiplier(step, warmup, schedule, total)
        )

    # -- accessors --

    @property
    def policy(self) -> nn.Module:
        """The policy module (unwrapped from DDP; under FSDP its parameters are shards)."""
        return self.parallelism.unwrap(self.model)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # -- the update --

    def _token_terms(
        self, module: nn.Module, micro: TrainBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, s]`` log-probs (and entropies) of the micro-batch's trainable tokens under ``module``;
        the rows' shared prompts are computed once, and only the logits of trainable tokens
        (:mod:`trainer.shared_prefix`)."""
        with self._autocast():
            token_logits, _ = trainable_logits(
                module,
                micro.input_ids,
                micro.attention_mask,
                micro.response_mask,
                share_prompts=self.parallelism.forwards_may_differ,
            )
        return selected_logprobs_and_entropy(
            token_logits,
            micro.input_ids,
            micro.response_mask,
            micro.temperature,
            micro.top_p,
            micro.top_k,
            with_entropy,
        )

    def _advantages(
        self, batch: TrainBatch, micros: list[TrainBatch], num_micro: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(advantages, returns, old_values or None)``, ``[B, S]``, under no_grad: token rewards
        (per turn when the batch has its turn structure), the configured estimator, then, with
        ``algorithm.whiten_advantages``, whitening over the trainable tokens (the returns, the
        critic's targets, stay in reward units)."""
        mask = batch.response_mask
        if batch.turn_rewards is not None:
            token_rewards = place_rewards(
                torch.zeros_like(batch.scores), mask, batch.turn_rewards, batch.turn_end_indices
            )
        else:
            token_rewards = place_rewards(batch.scores, mask)
        critic_values = self._critic_values(batch, micros, num_micro) if self.critic is not None else None
        turns = (
            {"turns": episode_turns(batch.input_ids, mask, batch.turn_end_indices)}
            if self.estimator.needs_turns
            else {}
        )
        advantages, returns = self.estimator.fn(
            token_rewards, critic_values, mask, batch.group_ids, self.algo, **turns
        )
        if self.algo.whitens_advantages:
            advantages = masked_whiten(advantages, mask, sum_over_ranks=self.parallelism.all_reduce)
        unweighted = advantages
        if self.algo.share_duplicate_advantage:
            shares = duplicate_shares(batch.input_ids, batch.attention_mask, batch.group_ids, batch.job_ids)
            advantages = advantages * shares.unsqueeze(1)
        if self.algo.inverse_probability_advantage is not None:
            weighted, applies = inverse_probability_advantages(
                unweighted,
                batch.behaviour_logprobs,
                mask,
                batch.group_ids,
                scope=self.algo.inverse_probability_advantage,
            )
            advantages = torch.where(applies, weighted, advantages)
        return advantages, returns, None if critic_values is None else critic_values.values

    def _critic_values(self, batch: TrainBatch, micros: list[TrainBatch], num_micro: int) -> CriticValues:
        """The critic's values of ``batch``, ``[B, S]`` on the response mask, and the bootstrap:
        for a truncated row (with ``algorithm.bootstrap_truncated``) the value of the state after
        its last real token, the state it was cut in; 0 for an episode that ended."""
        assert self.critic is not None
        values = torch.zeros_like(batch.response_mask)
        final_values = torch.zeros_like(batch.scores)
        for i in range(num_micro):  # as many forwards as the busiest rank: FSDP gathers in each
            micro = micros[min(i, len(micros) - 1)]
            with self._autocast():
                out = self.critic(micro.input_ids, micro.attention_mask)
            if i < len(micros):
                micro.scatter_rows(values, out.values.float())
                micro.scatter_rows(final_values, out.final_values.float())
        bootstrap = torch.zeros_like(final_values)
        if self.algo.bootstraps_truncated:
            bootstrap = torch.where(batch.truncated, final_values, bootstrap)
        return CriticValues(values * batch.response_mask, bootstrap)

    def _denominator(self, batch: TrainBatch) -> float:
        """What each micro-batch's loss sum is divided by, so summed over micro-batches (and
        averaged over ranks by the gradient reduction) it is the loss of the whole batch."""
        if self.algo.loss_agg == "token-mean":
            local = batch.response_mask.sum()
        else:
            local = (batch.response_mask.sum(dim=1) > 0).float().sum()
        total = self.parallelism.all_reduce(local.detach().clone().float())
        return max(float(total), 1.0) / self.parallelism.world_size

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch`` (this rank's share under distributed); returns its metrics."""
        start = time.perf_counter()
        batch = batch.to(self.device)
        micros = micro_batches(batch, self.optim_config.micro_batch_tokens)
        num_micro = self.parallelism.all_reduce_max(len(micros))
        denominator = self._denominator(batch)
        mask = batch.response_mask

        with torch.no_grad():
            advantages, returns, old_values = self._advantages(batch, micros, num_micro)
            self.last_advantages = (advantages * mask).cpu()
            ref_logprobs: list[torch.Tensor | None] = [None] * len(micros)
            if self.reference_model is not None:
                for i, micro in enumerate(micros):
                    ref_logprobs[i] = self._token_terms(self.reference_model, micro, False)[0]
        policy_micros, trained = self._policy_micro_batches(batch, micros, advantages)
        num_policy_micro = self.parallelism.all_reduce_max(len(policy_micros))
        trained_mask = mask * trained.unsqueeze(1).to(mask.dtype)
        # The entropy of rows the passes skip: their sampled tokens' -log-prob under the behaviour
        # policy, an unbiased estimate of its entropy, so train/entropy (the echo-trap watch)
        # still covers the whole batch when most groups have no signal.
        sampled_entropy = float(
            aggregate_loss(-batch.behaviour_logprobs, mask - trained_mask, self.algo.loss_agg, denominator)
        )

        entropy_coef = self.algo.entropy_coef
        kl_coef = self.algo.kl_coef
        old_logprobs = torch.zeros_like(mask)
        sums: dict[str, float] = {
            "pg_loss": 0.0,
            "vf_loss": 0.0,
            "entropy": 0.0,
            "kl": 0.0,
            "clipfrac": 0.0,
            "dual_clipfrac": 0.0,
            "approx_kl": 0.0,
            "vf_clipfrac": 0.0,
            "grad_norm": 0.0,
            "critic_grad_norm": 0.0,
        }
        token_weight_total = 0.0
        skipped = 0
        lr = self.lr
        epochs = self.algo.ppo_epochs
        for epoch in range(epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(num_policy_micro):
                last = i == num_policy_micro - 1
                with self.parallelism.grad_sync(self.model, last):
                    if i >= len(policy_micros):  # keeps collectives in step with ranks that have more
                        self._dummy_backward(self.model, micros[-1])
                        continue
                    micro = policy_micros[i]
                    logprobs, entropy = self._token_terms(self.model, micro, True)
                    assert entropy is not None
                    m_mask = micro.response_mask
                    if epoch == 0:
                        micro.scatter_rows(old_logprobs, logprobs.detach())
                    pg_loss, stats = ppo_policy_loss(
                        logprobs,
                        micro.behaviour_logprobs,
                        micro.gather_rows(advantages),
                        m_mask,
                        clip_low=self.algo.clip_low,
                        clip_high=self.algo.clip_high,
                        dual_clip=self.algo.dual_clip,
                        loss_agg=self.algo.loss_agg,
                        global_denominator=denominator,
                    )
                    entropy_loss = aggregate_loss(entropy, m_mask, self.algo.loss_agg, denominator)
                    loss = pg_loss - entropy_coef * entropy_loss
                    ref = ref_logprobs[i]
                    if ref is not None:
                        kl = kl_penalty(logprobs, ref, kind=self.algo.kl_estimator)
                        kl_loss = aggregate_loss(kl, m_mask, self.algo.loss_agg, denominator)
                        if kl_coef > 0:
                            loss = loss + kl_coef * kl_loss
                        sums["kl"] += float(kl_loss.detach())
                    loss.backward()
                    tokens = float(m_mask.sum())
                    token_weight_total += tokens
                    sums["pg_loss"] += float(pg_loss.detach())
                    sums["entropy"] += float(entropy_loss.detach())
                    for name in ("clipfrac", "dual_clipfrac", "approx_kl"):
                        sums[name] += float(stats[name]) * tokens
            if num_policy_micro == 0:  # every row skipped: the step of a zero gradient (Adam's moments move)
                for parameter in self.model.parameters():
                    if parameter.requires_grad:
                        parameter.grad = torch.zeros_like(parameter)
            grad_norm = self._clip_and_step(self.model, self.optimizer)
            sums["grad_norm"] += grad_norm
            skipped += int(not math.isfinite(grad_norm))

            if self.critic is not None:
                assert old_values is not None and self.critic_optimizer is not None
                self.critic_optimizer.zero_grad(set_to_none=True)
                for i in range(num_micro):
                    with self.parallelism.grad_sync(self.critic, i == num_micro - 1):
                        if i >= len(micros):
                            self._dummy_backward(self.critic, micros[-1])
                            continue
                        micro = micros[i]
                        with self._autocast():
                            values = self.critic(micro.input_ids, micro.attention_mask).values.float()
                        vf_loss, vstats = value_loss(
                            values,
                            micro.gather_rows(old_values),
                            micro.gather_rows(returns),
                            micro.response_mask,
                            clip_range=self.algo.critic.value_clip,
                            loss_agg=self.algo.loss_agg,
                            global_denominator=denominator,
                        )
                        vf_loss.backward()
                        sums["vf_loss"] += float(vf_loss.detach())
                        sums["vf_clipfrac"] += float(vstats["vf_clipfrac"]) * float(micro.response_mask.sum())
                sums["critic_grad_norm"] += self._clip_and_step(self.critic, self.critic_optimizer)

        self.scheduler.step()
        if self.critic_scheduler is not None:
            self.critic_scheduler.step()
        self.step += 1

        with torch.no_grad():
            gap = (old_logprobs - batch.behaviour_logprobs).abs()
            local = torch.stack(
                [
                    (gap * trained_mask).sum(),
                    mask.sum(),
                    batch.attention_mask.sum().float(),
                    (advantages * mask).sum(),
                    trained_mask.sum(),
                    (~trained).sum().float(),
                ]
            ).float()
            totals = self.parallelism.all_reduce(local.clone())
        tokens_weight = max(token_weight_total, 1.0)
        metric_values = {
            "train/pg_loss": sums["pg_loss"] / epochs,
            "train/vf_loss": sums["vf_loss"] / epochs,
            "train/entropy": sums["entropy"] / epochs + sampled_entropy,
            "train/kl": sums["kl"] / epochs,
            "train/clipfrac": sums["clipfrac"] / tokens_weight,
            "train/dual_clipfrac": sums["dual_clipfrac"] / tokens_weight,
            "train/approx_kl": sums["approx_kl"] / tokens_weight,
            "train/vf_clipfrac": sums["vf_clipfrac"] / tokens_weight,
            "train/grad_norm": sums["grad_norm"] / epochs,
            "train/critic_grad_norm": sums["critic_grad_norm"] / epochs,
        }
        # pg_loss, entropy, kl and vf_loss already are global means (their sum over ranks /
        # world_size); the others are this rank's, averaged over ranks here.
        rank_means = ["train/clipfrac", "train/dual_clipfrac", "train/approx_kl", "train/vf_clipfrac"]
        if self.parallelism.distributed:
            keys = list(metric_values)
            packed = torch.tensor([metric_values[k] for k in keys], dtype=torch.float64, device=self.device)
            self.parallelism.all_reduce(packed)
            for key, value in zip(keys, packed.tolist(), strict=True):
                if key in rank_means or key.endswith("grad_norm"):
                    metric_values[key] = value / self.parallelism.world_size
                else:
                    metric_values[key] = value
        elapsed = time.perf_counter() - start
        metric_values.update(
            {
                "train/lr": lr,
                "train/adv_mean": float(totals[3] / totals[1].clamp(min=1.0)),
                "train/skipped_steps": float(skipped),
                "rollout/logprob_gap": float(totals[0] / totals[4].clamp(min=1.0)),
                "system/update_tokens": float(totals[2]),
                "system/update_trainable_tokens": float(totals[1]),
                "system/micro_batches": float(len(policy_micros)),
                "system/update_skipped_rows": float(totals[5]),
                "system/update_s": elapsed,
                "system/update_tokens_per_s": float(totals[2]) / max(elapsed, 1e-9),
            }
        )
        return metric_values

    @property
    def _skips_rows(self) -> bool:
        """Whether rows without advantage skip the policy's passes: when the loss is the clipped
        policy term alone (no entropy bonus, no KL term), the only term such a row is in."""
        return self.algo.entropy_coef == 0 and self.reference_model is None

    def _policy_micro_batches(
        self, batch: TrainBatch, micros: list[TrainBatch], advantages: torch.Tensor
    ) -> tuple[list[TrainBatch], torch.Tensor]:
        """The micro-batches the policy's passes run, and which of ``batch``'s rows they hold (``[B]``).

        A row whose advantage is 0 at every response token has a policy loss of -0 x ratio: its
        gradient is exactly 0 whatever the weights, so with :attr:`_skips_rows` its forward and
        backward are skipped and the step is the same. In the recipe's batches such rows (groups
        whose episodes all scored alike) were 31-71% of the tokens (updates 152-159, one run).
        """
        every = torch.ones(batch.size, dtype=torch.bool, device=advantages.device)
        if not self._skips_rows:
            return micros, every
        trained = ((advantages != 0) & (batch.response_mask > 0)).any(dim=1)
        if bool(trained.all()):
            return micros, trained
        rows = trained.nonzero().flatten().tolist()
        if not rows:
            return [], trained
        return micro_batches(batch.select(rows), self.optim_config.micro_batch_tokens), trained

    def _dummy_backward(self, module: nn.Module, micro: TrainBatch) -> None:
        """A zero-weight forward/backward: the collectives of a micro-batch, no gradient."""
        row = micro.select([0])
        with self._autocast():
            out = module(input_ids=row.input_ids, attention_mask=row.attention_mask)
        tensor = out.logits if hasattr(out, "logits") else out.values
        (tensor.float().sum() * 0.0).backward()

    def _clip_and_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        """Clip the gradient norm (``optim.grad_clip``), step; a non-finite norm skips the step."""
        params = [p for p in module.parameters() if p.grad is not None]
        max_norm = self.optim_config.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        value = float(norm)
        if math.isfinite(value):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value

    # -- state --

    def _critic_state(self) -> dict[str, Any] | None:
        if self.critic is None:
            return None
        assert self.critic_optimizer is not None and self.critic_scheduler is not None
        return {
            "model": self.parallelism.full_model_state(self.critic, rank0_only=True),
            "optimizer": self.parallelism.full_optim_state(self.critic, self.critic_optimizer),
            "scheduler": self.critic_scheduler.state_dict(),
        }

    def _load_critic_state(self, state: dict[str, Any]) -> None:
        if self.critic is None:
            raise ValueError("this updater has no critic to load a critic state into")
        assert self.critic_optimizer is not None and self.critic_scheduler is not None
        self.parallelism.set_full_model_state(self.critic, state["model"])
        self.parallelism.set_full_optim_state(self.critic, self.critic_optimizer, state["optimizer"])
        self.critic_scheduler.load_state_dict(state["scheduler"])

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        self.parallelism.set_full_optim_state(self.model, self.optimizer, state)

    def _load_scheduler(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        self.step = int(state.get("last_epoch", self.step))

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, critic (model, optimizer, scheduler) and step; not the policy's
        weights (those go in the HF directory). A collective under distributed."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "optimizer": self.parallelism.full_optim_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "critic": self._critic_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (the policy's weights are loaded separately)."""
        self._load_optimizer(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("critic") is not None:
            self._load_critic_state(state["critic"])
        elif self.critic is not None:
            raise ValueError("the state has no critic but this updater has one")
        self.step = int(state["step"])

    def checkpoint_parts(self, for_loading: bool = False) -> dict[str, Any]:
        """``optimizer=, scheduler=, critic=`` for :meth:`CheckpointStore.save` / ``load``.

        ``store.save(step, updater.gathered_policy(), tokenizer, **updater.checkpoint_parts())``
        and ``store.load(policy=updater.policy, **updater.checkpoint_parts(for_loading=True))``
        (single process; under FSDP load the weights with :meth:`load_policy_weights`).
        Saving snapshots the states now (a collective under distributed: call on every rank);
        ``critic`` is None without a critic.
        """
        snap = not for_loading
        critic = None
        if self.critic is not None:
            critic = _StatePart(self._critic_state() if snap else None, self._load_critic_state)
        return {
            "optimizer": _StatePart(
                self.parallelism.full_optim_state(self.model, self.optimizer) if snap else None,
                self._load_optimizer,
            ),
            "scheduler": _StatePart(self.scheduler.state_dict() if snap else None, self._load_scheduler),
            "critic": critic,
        }

    def full_policy_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The policy's full (unsharded) state dict; under FSDP a collective, and with
        ``rank0_only`` only rank 0 gets it (on CPU), the others an empty dict."""
        return self.parallelism.full_model_state(self.model, rank0_only)

    def gathered_policy(self) -> nn.Module | None:
        """A plain Hugging Face model with the full current weights, for ``save_pretrained``.

        Single process and DDP: the policy itself. FSDP: a collective; rank 0 gets a CPU copy
        built from the policy's config, the other ranks None.
        """
        if self.parallelism.mode != "fsdp":
            return self.policy
        state = self.full_policy_state_dict(rank0_only=True)
        if self.parallelism.rank != 0:
            return None
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_config(self.policy.config, dtype=torch.float32)
        plain.load_state_dict(state)
        plain.generation_config = self.policy.generation_config
        return plain

    def load_policy_weights(self, path: str) -> None:
        """Replace the policy's weights with those of an HF directory (every rank under FSDP)."""
        from services.policy import load_state_dict as load_weights_file
        from services.policy import load_weights_into

        if self.parallelism.mode == "fsdp":
            self.parallelism.set_full_model_state(self.model, load_weights_file(path))
        else:
            load_weights_into(self.policy, path)
