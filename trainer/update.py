"""The policy (and critic) update step: one :meth:`PolicyUpdater.update` per collated batch.

Read top to bottom, one update is:

1. Micro-batches (:func:`trainer.batch.micro_batches`) of at most ``optim.micro_batch_tokens``
   padded tokens. Every loss divides its micro-batch *sum* by the token (or episode) count of the
   whole batch (``global_denominator``), so the gradients accumulated over micro-batches are the
   gradient of the full-batch loss.
2. Advantages under ``no_grad``: token rewards by :func:`~trainer.algorithms.place_rewards` (per
   turn when the batch has its turn structure, else the episode return on the last trainable
   token), then the configured estimator (GAE with the critic's values; GRPO, RLOO, REINFORCE++).
   With ``kl_coef > 0`` the reference policy's log-probs are computed here too.
3. ``ppo_epochs`` passes over the micro-batches, one optimizer step per pass: PPO loss with
   decoupled and dual clipping against the **behaviour** log-probs (DESIGN.md, "Weights"), minus
   the entropy bonus, plus ``kl_coef`` x KL(pi || pi_ref); gradient clipping; AdamW step. The
   critic takes its own step per pass on the clipped value loss. The LR schedule advances once
   per update.

Old log-probs. The trainer recomputes the log-probs of the sampled tokens with its current weights
at the rollout temperature and logs ``rollout/logprob_gap`` = mean |recomputed - behaviour| over
the trainable tokens (engine/trainer mismatch, stale weights). No extra forward pass is spent on
it: the first pass runs every micro-batch before the first optimizer step, so its log-probs
*are* the current weights' log-probs, detached. (Exact for models without dropout, which RL
fine-tuning turns off; the tiny model and Qwen2 have none.)

Log-probs and entropy are computed only at trainable positions (one ``log_softmax`` shared by
both), since most tokens of a multi-turn episode are observations.

Distributed. When ``torch.distributed`` is initialised with ``world_size > 1`` the policy (and the
critic) are sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``, each decoder layer and the
root); ``parallel="ddp"`` replicates them with DDP instead. Both run on CPU with the gloo backend
(tested with 2 processes) and on GPUs with NCCL under ``torchrun``. Each rank updates on its own
batch (whole groups: GRPO/RLOO baselines and REINFORCE++ whitening are per rank); the token count
is summed across ranks so the averaged gradient is the token mean of the global batch, and ranks
with fewer micro-batches run zero-weight ones so every rank issues the same collectives. Metrics
are averaged over ranks. :meth:`checkpoint_parts`, :meth:`gathered_policy` and
:meth:`full_policy_state_dict` are collectives there: call them on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer.algorithms import (
    aggregate_loss,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    place_rewards,
    ppo_policy_loss,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    value_loss,
)
from trainer.algorithms.losses import GREEDY_TEMPERATURE
from trainer.batch import TrainBatch, micro_batches
from trainer.config import TrainConfig

Parallel = Literal["fsdp", "ddp"]
STATE_FORMAT = 1


# --------------------------------------------------------------------------------------------
# Per-token terms at trainable positions
# --------------------------------------------------------------------------------------------


def selected_logprobs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, S]`` log-prob of each trainable token and entropy of the distribution it was sampled
    from, 0 elsewhere: the values of :func:`~trainer.algorithms.logprobs_from_logits` and
    :func:`~trainer.algorithms.next_token_entropy` at the trainable positions, from one
    ``log_softmax`` over only those rows of ``logits`` ``[B, S, V]``."""
    positions = response_mask[:, 1:].bool()  # token t (t >= 1) is predicted by logits[:, t-1]
    scaled = logits[:, :-1][positions].float()
    if temperature >= GREEDY_TEMPERATURE and temperature != 1.0:
        scaled = scaled / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    picked = log_probs.gather(-1, input_ids[:, 1:][positions].unsqueeze(-1)).squeeze(-1)
    full_mask = torch.zeros_like(response_mask, dtype=torch.bool)
    full_mask[:, 1:] = positions
    zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=logits.device)
    logprobs = zeros.masked_scatter(full_mask, picked)
    entropy = None
    if with_entropy:
        per_row = -(log_probs.exp() * log_probs).sum(dim=-1)
        entropy = zeros.masked_scatter(full_mask, per_row)
    return logprobs, entropy


# --------------------------------------------------------------------------------------------
# The critic: the policy's backbone with a scalar head
# --------------------------------------------------------------------------------------------


class ValueModel(nn.Module):
    """A critic of the policy's architecture: its backbone (``AutoModel``) and a linear value head.

    ``forward`` returns ``[B, S]`` values aligned like the log-probs: position ``t`` holds
    V(state before token ``t`` is sampled) = ``head(hidden[:, t-1])``; position 0 holds 0.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> ValueModel:
        """A copy of the policy's backbone (``policy.base_model``) with a zero-initialised head."""
        backbone = copy.deepcopy(policy.base_model)
        return cls(backbone, int(policy.config.hidden_size))

    @classmethod
    def from_pretrained(cls, path: str) -> ValueModel:
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
        return cls(backbone, int(backbone.config.hidden_size))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        values = self.value_head(hidden).squeeze(-1).float()
        return torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)


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
    config: the run's :class:`TrainConfig` (``optim``, ``algorithm``, ``rollout.sampling``).
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
        self.temperature = float(config.rollout.sampling.temperature)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.parallel: Parallel | None = parallel if self.distributed else None
        bf16 = self.optim_config.bf16
        self.autocast = self.device.type == "cuda" if bf16 == "auto" else bool(bf16)

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
        if critic is None and self.algo.advantage == "gae":
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
        self.model = self._wrap(model)
        self.critic = self._wrap(critic) if critic is not None else None

        self.optimizer = self._make_optimizer(self.model, self.optim_config.lr)
        self.scheduler = self._make_scheduler(self.optimizer)
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if self.critic is not None:
            self.critic_optimizer = self._make_optimizer(self.critic, self.algo.critic.lr)
            self.critic_scheduler = self._make_scheduler(self.critic_optimizer)
        self.step = 0

    # -- construction --

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.parallel is None:
            return module
        if self.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)
        from torch.distributed.fsdp import fully_shard

        target = module.backbone if isinstance(module, ValueModel) else module
        layer_names = set(getattr(target, "_no_split_modules", None) or [])
        for sub in list(module.modules()):
            if sub is not module and type(sub).__name__ in layer_names:
                fully_shard(sub)
        fully_shard(module)
        return module

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
        return getattr(self.model, "module", self.model) if self.parallel == "ddp" else self.model

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- distributed helpers --

    def _all_reduce(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor

    @contextlib.contextmanager
    def _grad_sync(self, module: nn.Module, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch."""
        if self.parallel == "ddp" and not sync:
            with module.no_sync():  # type: ignore[operator]
                yield
            return
        if self.parallel == "fsdp":
            module.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # -- the update --

    def _token_terms(
        self, module: nn.Module, micro: TrainBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._autocast():
            logits = module(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
        return selected_logprobs_and_entropy(
            logits, micro.input_ids, micro.response_mask, self.temperature, with_entropy
        )

    def _advantages(
        self, batch: TrainBatch, micros: list[TrainBatch]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(advantages, returns, old_values or None)``, ``[B, S]``, under no_grad."""
        mask = batch.response_mask
        if batch.turn_rewards is not None:
            token_rewards = place_rewards(
                torch.zeros_like(batch.scores), mask, batch.turn_rewards, batch.turn_end_indices
            )
        else:
            token_rewards = place_rewards(batch.scores, mask)
        kind = self.algo.advantage
        if kind == "gae":
            values = torch.zeros_like(mask)
            assert self.critic is not None
            for micro in micros:
                with self._autocast():
                    micro.scatter_rows(values, self.critic(micro.input_ids, micro.attention_mask).float())
            values = values * mask
            advantages, returns = gae_advantages(token_rewards, values, mask, self.algo.gamma, self.algo.lam)
            return advantages, returns, values
        scores = (token_rewards * mask).sum(dim=1)
        if kind == "grpo":
            advantages, returns = grpo_advantages(scores, mask, batch.group_ids, norm_adv=self.algo.norm_adv)
        elif kind == "rloo":
            advantages, returns = rloo_advantages(scores, mask, batch.group_ids)
        elif kind == "reinforce_pp":
            advantages, returns = reinforce_plus_plus_advantages(token_rewards, mask, self.algo.gamma)
        else:
            raise ValueError(f"unknown advantage estimator {kind!r}")
        return advantages, returns, None

    def _denominator(self, batch: TrainBatch) -> float:
        """What each micro-batch's loss sum is divided by, so summed over micro-batches (and
        averaged over ranks by the gradient reduction) it is the loss of the whole batch."""
        if self.algo.loss_agg == "token-mean":
            local = batch.response_mask.sum()
        else:
            local = (batch.response_mask.sum(dim=1) > 0).float().sum()
        total = self._all_reduce(local.detach().clone().float())
        return max(float(total), 1.0) / self.world_size

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch`` (this rank's share under distributed); returns its metrics."""
        start = time.perf_counter()
        batch = batch.to(self.device)
        micros = micro_batches(batch, self.optim_config.micro_batch_tokens)
        num_micro = len(micros)
        if self.distributed:
            count = torch.tensor([num_micro], device=self.device)
            num_micro = int(self._all_reduce(count, dist.ReduceOp.MAX))
        denominator = self._denominator(batch)
        mask = batch.response_mask

        with torch.no_grad():
            advantages, returns, old_values = self._advantages(batch, micros)
            ref_logprobs: list[torch.Tensor | None] = [None] * len(micros)
            if self.reference_model is not None:
                for i, micro in enumerate(micros):
                    ref_logprobs[i] = self._token_terms(self.reference_model, micro, False)[0]

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
            for i in range(num_micro):
                last = i == num_micro - 1
                with self._grad_sync(self.model, last):
                    if i >= len(micros):  # keeps collectives in step with ranks that have more
                        self._dummy_backward(self.model, micros[-1])
                        continue
                    micro = micros[i]
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
            grad_norm = self._clip_and_step(self.model, self.optimizer)
            sums["grad_norm"] += grad_norm
            skipped += int(not math.isfinite(grad_norm))

            if self.critic is not None:
                assert old_values is not None and self.critic_optimizer is not None
                self.critic_optimizer.zero_grad(set_to_none=True)
                for i in range(num_micro):
                    with self._grad_sync(self.critic, i == num_micro - 1):
                        if i >= len(micros):
                            self._dummy_backward(self.critic, micros[-1])
                            continue
                        micro = micros[i]
                        with self._autocast():
                            values = self.critic(micro.input_ids, micro.attention_mask).float()
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
                    (gap * mask).sum(),
                    mask.sum(),
                    batch.attention_mask.sum().float(),
                    (advantages * mask).sum(),
                ]
            ).float()
            totals = self._all_reduce(local.clone())
        tokens_weight = max(token_weight_total, 1.0)
        metric_values = {
            "train/pg_loss": sums["pg_loss"] / epochs,
            "train/vf_loss": sums["vf_loss"] / epochs,
            "train/entropy": sums["entropy"] / epochs,
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
        if self.distributed:
            keys = list(metric_values)
            packed = torch.tensor([metric_values[k] for k in keys], dtype=torch.float64, device=self.device)
            self._all_reduce(packed)
            for key, value in zip(keys, packed.tolist(), strict=True):
                if key in rank_means or key.endswith("grad_norm"):
                    metric_values[key] = value / self.world_size
                else:
                    metric_values[key] = value
        elapsed = time.perf_counter() - start
        metric_values.update(
            {
                "train/lr": lr,
                "train/adv_mean": float(totals[3] / totals[1].clamp(min=1.0)),
                "train/skipped_steps": float(skipped),
                "rollout/logprob_gap": float(totals[0] / totals[1].clamp(min=1.0)),
                "system/update_tokens": float(totals[2]),
                "system/update_trainable_tokens": float(totals[1]),
                "system/micro_batches": float(len(micros)),
                "system/update_s": elapsed,
                "system/update_tokens_per_s": float(totals[2]) / max(elapsed, 1e-9),
            }
        )
        return metric_values

    def _dummy_backward(self, module: nn.Module, micro: TrainBatch) -> None:
        """A zero-weight forward/backward: the collectives of a micro-batch, no gradient."""
        row = micro.select([0])
        with self._autocast():
            out = module(input_ids=row.input_ids, attention_mask=row.attention_mask)
        tensor = out.logits if hasattr(out, "logits") else out
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

    def _full_model_state(self, module: nn.Module, rank0_only: bool) -> dict[str, Any]:
        if self.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
            return get_model_state_dict(module, options=options)
        inner = getattr(module, "module", module) if self.parallel == "ddp" else module
        return inner.state_dict()

    def _set_full_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        if self.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))
            return
        inner = getattr(module, "module", module) if self.parallel == "ddp" else module
        inner.load_state_dict(state)

    def _full_optim_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(module, optimizer, options=options)
        return optimizer.state_dict()

    def _set_full_optim_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if self.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
            return
        optimizer.load_state_dict(state)

    def _critic_state(self) -> dict[str, Any] | None:
        if self.critic is None:
            return None
        assert self.critic_optimizer is not None and self.critic_scheduler is not None
        return {
            "model": self._full_model_state(self.critic, rank0_only=True),
            "optimizer": self._full_optim_state(self.critic, self.critic_optimizer),
            "scheduler": self.critic_scheduler.state_dict(),
        }

    def _load_critic_state(self, state: dict[str, Any]) -> None:
        if self.critic is None:
            raise ValueError("this updater has no critic to load a critic state into")
        assert self.critic_optimizer is not None and self.critic_scheduler is not None
        self._set_full_model_state(self.critic, state["model"])
        self._set_full_optim_state(self.critic, self.critic_optimizer, state["optimizer"])
        self.critic_scheduler.load_state_dict(state["scheduler"])

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        self._set_full_optim_state(self.model, self.optimizer, state)

    def _load_scheduler(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        self.step = int(state.get("last_epoch", self.step))

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, critic (model, optimizer, scheduler) and step; not the policy's
        weights (those go in the HF directory). A collective under distributed."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "optimizer": self._full_optim_state(self.model, self.optimizer),
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
                self._full_optim_state(self.model, self.optimizer) if snap else None, self._load_optimizer
            ),
            "scheduler": _StatePart(self.scheduler.state_dict() if snap else None, self._load_scheduler),
            "critic": critic,
        }

    def full_policy_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The policy's full (unsharded) state dict; under FSDP a collective, and with
        ``rank0_only`` only rank 0 gets it (on CPU), the others an empty dict."""
        return self._full_model_state(self.model, rank0_only)

    def gathered_policy(self) -> nn.Module | None:
        """A plain Hugging Face model with the full current weights, for ``save_pretrained``.

        Single process and DDP: the policy itself. FSDP: a collective; rank 0 gets a CPU copy
        built from the policy's config, the other ranks None.
        """
        if self.parallel != "fsdp":
            return self.policy
        state = self.full_policy_state_dict(rank0_only=True)
        if self.rank != 0:
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

        if self.parallel == "fsdp":
            self._set_full_model_state(self.model, load_weights_file(path))
        else:
            load_weights_into(self.policy, path)
