"""trainer/update.py: the PPO-family update step on the tiny model, with sampled trajectories."""

from __future__ import annotations

import copy
import datetime
import itertools
import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from synthetic import synthetic_trajectories

from deploy.model_init import init_tiny_model
from services.policy import load_policy
from services.rollout_protocol import SamplingParams, Trajectory
from trainer.algorithms import (
    inverse_probability_advantages,
    logprobs_from_logits,
    next_token_entropy,
    predicting_logits,
    selected_logprobs_and_entropy,
)
from trainer.algorithms.advantages import first_reply_mask, reply_count
from trainer.batch import TrainBatch, collate
from trainer.checkpoint import CheckpointStore
from trainer.config import TrainConfig
from trainer.critic import ValueModel
from trainer.update import PolicyUpdater, _lr_multiplier

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", 0, ["game/frozenlake"], 10, 5)


def _vocab(tokenizer) -> list[int]:
    return [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]


def _config(**algorithm) -> TrainConfig:
    """Float32 unless ``optim`` says otherwise: these tests check the update against its formulas
    to 1e-5, which ``bf16: auto`` would turn into a check of bfloat16 rounding on an AMX CPU."""
    optim = algorithm.pop("optim", {})
    return TrainConfig.from_dict(
        {
            "rollout": {"sampling": {"temperature": TEMPERATURE, "max_tokens": 4}},
            "algorithm": algorithm,
            "optim": {"lr": 1e-3, "weight_decay": 0.0, "micro_batch_tokens": 8192, "bf16": False, **optim},
        }
    )


def _batch(model, tokenizer, seed: int = 0, groups: int = 3, group_size: int = 4, **kwargs) -> TrainBatch:
    trajectories = synthetic_trajectories(
        model,
        groups=groups,
        group_size=group_size,
        vocab_ids=_vocab(tokenizer),
        first_prompt_len=kwargs.pop("first_prompt_len", 20),
        observation_len=7,
        turns=kwargs.pop("turns", (1, 3)),
        sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=kwargs.pop("max_tokens", 4)),
        seed=seed,
        **kwargs,
    )
    return collate(trajectories, tokenizer.pad_token_id)


def _selected_terms(
    logits: torch.Tensor, batch: TrainBatch, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The update's log-probs (and entropies) of ``batch``'s trainable tokens, from full logits."""
    return selected_logprobs_and_entropy(
        predicting_logits(logits, batch.response_mask),
        batch.input_ids,
        batch.response_mask,
        batch.temperature,
        batch.top_p,
        batch.top_k,
        with_entropy,
    )


def test_fused_terms_match_the_algorithm_functions(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs, entropy = _selected_terms(logits, batch)
    mask = batch.response_mask
    expected = logprobs_from_logits(logits, batch.input_ids, TEMPERATURE) * mask
    assert torch.allclose(logprobs, expected, atol=1e-5)
    assert torch.allclose(entropy, next_token_entropy(logits, TEMPERATURE) * mask, atol=1e-5)


def test_metrics_and_first_update_logprob_gap(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer)
    updater = PolicyUpdater(model, _config(optim={"micro_batch_tokens": 64}))
    metrics = updater.update(batch)
    for name in (
        "train/pg_loss",
        "train/vf_loss",
        "train/entropy",
        "train/kl",
        "train/clipfrac",
        "train/grad_norm",
        "train/lr",
        "rollout/logprob_gap",
        "system/update_tokens",
        "system/update_s",
    ):
        assert name in metrics and math.isfinite(metrics[name]), name
    # Sampled by these very weights at this temperature: the recomputed log-probs agree.
    assert metrics["rollout/logprob_gap"] < 1e-4
    assert metrics["train/clipfrac"] == 0.0  # ratio 1 on the first pass
    assert metrics["system/update_tokens"] == batch.num_tokens
    assert metrics["system/micro_batches"] > 1
    assert metrics["train/lr"] == pytest.approx(1e-3)
    assert 0 < metrics["train/entropy"] < math.log(len(tokenizer))
    # The weights moved, so the same batch is now off-policy by a measurable gap.
    assert updater.update(batch)["rollout/logprob_gap"] > 1e-4


def _first_step(model_dir: Path, batch: TrainBatch, bf16: bool | str) -> tuple[PolicyUpdater, dict, list]:
    """An update of a fresh policy; its metrics and the gradients its optimizer step applied."""
    model, _ = load_policy(model_dir)
    updater = PolicyUpdater(model, _config(optim={"micro_batch_tokens": 64, "bf16": bf16}))
    grads: list[torch.Tensor] = []
    updater.optimizer.register_step_pre_hook(  # after clipping, before the step
        lambda optimizer, args, kwargs: grads.extend(
            p.grad.detach().clone() for p in updater.policy.parameters()
        )
    )
    return updater, updater.update(batch), grads


def test_bf16_autocast_on_the_cpu_is_the_float32_update_up_to_bfloat16_rounding(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer)
    exact, exact_metrics, exact_grads = _first_step(model_dir, batch, False)
    rounded, metrics, grads = _first_step(model_dir, batch, True)
    assert not exact.autocast and rounded.autocast
    assert all(math.isfinite(value) for value in metrics.values())
    # Sampled by these weights: bfloat16 forwards recompute the log-probs to its rounding (float32:
    # under 1e-4, the test above), so the gap shows the autocast is real.
    assert 1e-5 < metrics["rollout/logprob_gap"] < 1e-2, metrics["rollout/logprob_gap"]
    assert metrics["train/entropy"] == pytest.approx(exact_metrics["train/entropy"], rel=1e-2)
    flat, flat_exact = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in exact_grads])
    assert float(flat_exact.abs().sum()) > 0
    relative = torch.linalg.vector_norm(flat - flat_exact) / torch.linalg.vector_norm(flat_exact)
    assert float(relative) < 5e-2
    # Autocast computes in bfloat16; Adam updates float32 weights.
    assert all(p.dtype == torch.float32 for p in rounded.policy.parameters())


def test_bf16_auto_on_the_cpu_follows_its_amx_tiles(model_dir: Path) -> None:
    """``auto`` autocasts on a CPU only where the kernel reports AMX tiles (bf16 in hardware)."""
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        None,
    )
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags to check against")
    model, _ = load_policy(model_dir)
    updater = PolicyUpdater(model, _config(optim={"bf16": "auto"}))
    assert updater.autocast == ("amx_tile" in flags)


def _sampled_batch(model, tokenizer, seed: int, samplings: list[SamplingParams]) -> TrainBatch:
    """One batch with a group of trajectories sampled by the engine's sampler per ``samplings``."""
    trajectories = [
        t
        for index, sampling in enumerate(samplings)
        for t in synthetic_trajectories(
            model,
            groups=1,
            group_size=4,
            vocab_ids=_vocab(tokenizer),
            first_prompt_len=20,
            observation_len=7,
            turns=(1, 3),
            sampling=sampling,
            seed=seed + index,
        )
    ]
    return collate(trajectories, tokenizer.pad_token_id)


@pytest.mark.parametrize(
    "samplings",
    [
        [SamplingParams(temperature=1.0, top_p=0.8, max_tokens=6)],
        [SamplingParams(temperature=1.0, top_k=50, max_tokens=6)],
        [
            SamplingParams(temperature=0.7, top_p=0.8, max_tokens=6),
            SamplingParams(temperature=1.3, top_k=50, max_tokens=6),
            SamplingParams(temperature=1.0, top_k=50, top_p=0.8, max_tokens=6),
        ],
    ],
    ids=["top_p_0.8", "top_k_50", "per_row_mix"],
)
def test_on_policy_ratio_is_one_under_top_p_and_top_k(
    model_dir: Path, samplings: list[SamplingParams]
) -> None:
    """The engine's sampler reports log-probs of the truncated distribution; the trainer must
    recompute the same ones, from each trajectory's own sampling (the config says T=0.8, no cut),
    or the on-policy ratio is the kept mass and clipping fires on fresh data."""
    model, tokenizer = load_policy(model_dir)
    assert len(tokenizer) > 50
    batch = _sampled_batch(model, tokenizer, 11, samplings)
    updater = PolicyUpdater(model, _config(optim={"micro_batch_tokens": 64}))
    metrics = updater.update(batch)
    assert metrics["rollout/logprob_gap"] < 1e-4
    assert metrics["train/clipfrac"] == 0.0
    # Token by token: ratio 1 +- 1e-4 on every trainable token, from the function the update uses.
    fresh, _ = load_policy(model_dir)
    with torch.no_grad():
        logits = fresh(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs, _ = _selected_terms(logits, batch, with_entropy=False)
    mask = batch.response_mask.bool()
    ratio = (logprobs - batch.behaviour_logprobs)[mask].exp()
    assert (ratio - 1).abs().max() < 1e-4


def _grads_of_one_update(model_dir: Path, batch: TrainBatch, budget: int, **algorithm) -> list[torch.Tensor]:
    model, _ = load_policy(model_dir)
    updater = PolicyUpdater(
        model, _config(optim={"micro_batch_tokens": budget, "grad_clip": None}, **algorithm)
    )
    captured: list[torch.Tensor] = []

    def capture(optimizer, args, kwargs) -> None:
        captured.extend(p.grad.detach().clone() for p in updater.policy.parameters())

    updater.optimizer.register_step_pre_hook(capture)
    metrics = updater.update(batch)
    assert metrics["system/micro_batches"] == (
        1 if budget >= batch.padded_tokens else metrics["system/micro_batches"]
    )
    return captured


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_accumulated_micro_batches_give_the_full_batch_gradient(model_dir: Path, loss_agg: str) -> None:
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer, seed=3)
    full = _grads_of_one_update(model_dir, batch, 10**6, loss_agg=loss_agg, entropy_coef=0.01)
    split = _grads_of_one_update(model_dir, batch, 50, loss_agg=loss_agg, entropy_coef=0.01)
    assert len(full) == len(split) > 0
    assert any(g.abs().sum() > 0 for g in full)
    for a, b in zip(full, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def _steps_of(
    model_dir: Path, batches: list[TrainBatch], every_row: bool
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[dict[str, float]]]:
    """A fresh policy updated once per batch with no entropy bonus: per update, the gradients its
    optimizer step applied, the weights after it, and its metrics. ``every_row``: with a frozen
    reference policy (KL logged, kl_coef 0), so every row is run."""
    model, _ = load_policy(model_dir)
    reference = copy.deepcopy(model) if every_row else None
    updater = PolicyUpdater(
        model, _config(entropy_coef=0.0, optim={"lr": 1e-2, "grad_clip": None}), reference_model=reference
    )
    grads: list[list[torch.Tensor]] = []
    updater.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: grads.append(
            [p.grad.detach().clone() for p in updater.policy.parameters()]
        )
    )
    weights, metrics = [], []
    for batch in batches:
        metrics.append(updater.update(batch))
        weights.append([p.detach().clone() for p in updater.policy.parameters()])
    return grads, weights, metrics


def _scored_by_group(trajectories: list[Trajectory], tokenizer, *, alike: set[int]) -> TrainBatch:
    """The groups whose index is in ``alike`` score 1 on every episode, the others 1 on their
    episodes that drew their first episode's token and 0 on the rest."""
    groups = list(dict.fromkeys(t.group_id for t in trajectories))
    first_token = {t.group_id: t.token_ids[-1] for t in reversed(trajectories)}
    scored = [
        _rewarded(
            t,
            1.0 if groups.index(t.group_id) in alike else float(t.token_ids[-1] == first_token[t.group_id]),
        )
        for t in trajectories
    ]
    return collate(scored, tokenizer.pad_token_id)


def test_rows_without_advantage_skip_the_policy_passes_and_leave_the_step_unchanged(model_dir: Path) -> None:
    """With no entropy bonus or KL term, a group whose episodes all scored alike (advantage 0 on
    every token) adds nothing to the gradient: its rows are not run, and the weights end exactly
    where running them leaves them, over two updates: one with such groups, one of them only
    (Adam's moments still move the weights on a zero gradient)."""
    model, tokenizer = load_policy(model_dir)
    trajectories = _one_turn(model, tokenizer, groups=4, group_size=4, max_tokens=2, seed=7)
    mixed = _scored_by_group(trajectories, tokenizer, alike={1, 3})
    alike = _scored_by_group(trajectories, tokenizer, alike={0, 1, 2, 3})
    assert mixed.scores[:4].unique().numel() == 2  # group 0 has a signal

    grads, weights, metrics = _steps_of(model_dir, [mixed, alike], every_row=False)
    every_grads, every_weights, every_metrics = _steps_of(model_dir, [mixed, alike], every_row=True)
    assert [m["system/update_skipped_rows"] for m in metrics] == [8.0, 16.0]
    assert [m["system/update_skipped_rows"] for m in every_metrics] == [0.0, 0.0]
    assert metrics[1]["system/micro_batches"] == 0
    assert any(g.abs().sum() > 0 for g in grads[0])
    for update in range(2):
        for a, b in zip(grads[update], every_grads[update], strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert all(g.abs().sum() == 0 for g in grads[1])
    # Adam moves every weight by about lr a step; float noise in near-zero gradients moves a few
    # by up to ~3e-6 more or less, with or without the skip.
    for a, b in zip(weights[1], every_weights[1], strict=True):
        assert torch.allclose(a, b, atol=2e-5)
    assert any(not torch.equal(a, b) for a, b in zip(weights[0], weights[1], strict=True))
    # The entropy the echo-trap watch reads still covers skipped rows: their sampled tokens'
    # -log-prob under the behaviour policy.
    sampled = (-alike.behaviour_logprobs * alike.response_mask).sum() / alike.response_mask.sum()
    assert metrics[1]["train/entropy"] == pytest.approx(float(sampled), rel=1e-5)
    assert metrics[1]["train/entropy"] > 0
    # The first pass's log-probs of the rows it ran are the behaviour's (sampled by these weights).
    assert metrics[0]["rollout/logprob_gap"] < 1e-4


def test_rows_without_advantage_are_run_for_the_entropy_bonus(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    trajectories = _one_turn(model, tokenizer, groups=2, group_size=4, max_tokens=2, seed=7)
    batch = _scored_by_group(trajectories, tokenizer, alike={1})
    updater = PolicyUpdater(model, _config(entropy_coef=0.01))
    assert updater.update(batch)["system/update_skipped_rows"] == 0.0


def _one_turn(
    model, tokenizer, *, groups: int, group_size: int, max_tokens: int, seed: int
) -> list[Trajectory]:
    """Single-turn episodes of ``max_tokens``-token replies sampled from ``model``."""
    return synthetic_trajectories(
        model,
        groups=groups,
        group_size=group_size,
        vocab_ids=_vocab(tokenizer),
        first_prompt_len=12,
        turns=(1, 1),
        sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens),
        seed=seed,
    )


def _rewarded(trajectory: Trajectory, reward: float) -> Trajectory:
    """``trajectory`` with its (one) turn and its return set to ``reward``."""
    turn = trajectory.turns[-1].model_copy(update={"reward": reward})
    return trajectory.model_copy(update={"reward": reward, "turns": [turn]})


def test_grpo_raises_the_probability_of_the_rewarded_token(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    # Single-turn, single-token replies; in group 0 the episodes that chose its first episode's
    # token X are rewarded; every other episode gets 0.
    trajectories = _one_turn(model, tokenizer, groups=4, group_size=8, max_tokens=1, seed=5)
    rewarded_group = trajectories[0].group_id
    chosen = trajectories[0].token_ids[-1]
    trajectories = [
        _rewarded(t, float(t.group_id == rewarded_group and t.token_ids[-1] == chosen)) for t in trajectories
    ]
    batch = collate(trajectories, tokenizer.pad_token_id)
    rewarded = [row for row in range(batch.size) if batch.scores[row] > 0]
    assert 0 < len(rewarded) < batch.size

    def prob_of_rewarded_tokens(policy) -> torch.Tensor:
        with torch.no_grad():
            logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logprobs = logprobs_from_logits(logits, batch.input_ids, TEMPERATURE)
        return logprobs[rewarded, -1].exp()

    before = prob_of_rewarded_tokens(model)
    updater = PolicyUpdater(model, _config(advantage="grpo", optim={"lr": 1e-2}))
    for _ in range(3):
        updater.update(batch)
    after = prob_of_rewarded_tokens(updater.policy)
    assert (after > before).all(), (before, after)
    assert after.mean() > 1.5 * before.mean()


def _trained_advantages(model_dir: Path, batch: TrainBatch, **algorithm) -> torch.Tensor:
    """The advantages a fresh GRPO updater with ``algorithm`` trains ``batch`` on (masked)."""
    fresh, _ = load_policy(model_dir)
    updater = PolicyUpdater(fresh, _config(advantage="grpo", **algorithm))
    updater.update(batch)
    assert updater.last_advantages is not None
    return updater.last_advantages


def test_identical_episodes_split_their_advantage_when_asked(model_dir: Path) -> None:
    """algorithm.share_duplicate_advantage: an episode sampled three times in its group trains
    with a third of its advantage on each copy; distinct episodes keep theirs."""
    model, tokenizer = load_policy(model_dir)
    trajectories = _one_turn(model, tokenizer, groups=2, group_size=4, max_tokens=2, seed=3)
    trajectories = [_rewarded(t, float(row == 0)) for row, t in enumerate(trajectories)]  # row 0 earns 1
    for row in (1, 2):  # rows 1 and 2 are row 0 sampled again
        trajectories[row] = trajectories[0].model_copy(update={"job_id": f"copy-{row}"})
    batch = collate(trajectories, tokenizer.pad_token_id)

    whole = _trained_advantages(model_dir, batch)
    shared = _trained_advantages(model_dir, batch, share_duplicate_advantage=True)
    assert whole[0].abs().sum() > 0
    assert torch.allclose(shared[:3], whole[:3] / 3)
    assert torch.allclose(shared[3:], whole[3:])


def test_one_reply_groups_take_inverse_probability_advantages_when_asked(model_dir: Path) -> None:
    """algorithm.inverse_probability_advantage: the updater trains one-reply groups on
    :func:`inverse_probability_advantages` of the plain advantages (in place of the shared ones)."""
    model, tokenizer = load_policy(model_dir)
    trajectories = _one_turn(model, tokenizer, groups=2, group_size=4, max_tokens=1, seed=4)
    trajectories = [_rewarded(t, float(row % 3 == 0)) for row, t in enumerate(trajectories)]
    batch = collate(trajectories, tokenizer.pad_token_id)

    whole = _trained_advantages(model_dir, batch)
    weighted = _trained_advantages(
        model_dir, batch, inverse_probability_advantage="one_reply", share_duplicate_advantage=True
    )
    expected, applies = inverse_probability_advantages(
        whole, batch.behaviour_logprobs, batch.response_mask, batch.group_ids
    )
    assert torch.equal(applies, batch.response_mask.bool())
    assert torch.allclose(weighted, expected, atol=1e-6)
    assert not torch.allclose(weighted, whole, atol=1e-3)


def test_multi_turn_groups_take_inverse_probability_advantages_on_their_first_reply(model_dir: Path) -> None:
    """algorithm.inverse_probability_advantage=first_reply: in multi-turn groups the first reply's
    tokens train on :func:`inverse_probability_advantages`, every later turn on the plain
    advantage; one_reply leaves such groups as they are."""
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer, seed=5, turns=(2, 3))
    assert (reply_count(batch.response_mask) >= 2).all()

    whole = _trained_advantages(model_dir, batch)
    first = _trained_advantages(model_dir, batch, inverse_probability_advantage="first_reply")
    expected, applies = inverse_probability_advantages(
        whole, batch.behaviour_logprobs, batch.response_mask, batch.group_ids, scope="first_reply"
    )
    assert torch.equal(applies, first_reply_mask(batch.response_mask))
    assert torch.allclose(first, expected, atol=1e-6)
    assert torch.equal(first[~applies], whole[~applies])
    assert not torch.allclose(first[applies], whole[applies], atol=1e-3)
    one_reply = _trained_advantages(model_dir, batch, inverse_probability_advantage="one_reply")
    assert torch.allclose(one_reply, whole)


def test_gae_critic_value_loss_decreases(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer, seed=7)
    batch.scores[:] = torch.linspace(0.0, 1.0, batch.size)
    batch.turn_rewards = None  # reward on the last trainable token
    config = _config(advantage="gae", gamma=0.99, lam=0.95, critic={"enabled": True, "lr": 1e-3})
    updater = PolicyUpdater(model, config, reference_model=copy.deepcopy(model))
    assert updater.critic is not None and updater.critic_optimizer is not None
    losses = [updater.update(batch)["train/vf_loss"] for _ in range(8)]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    metrics = updater.update(batch)
    assert metrics["train/kl"] > 0  # a reference is given: the KL to it is measured


def test_truncated_episodes_bootstrap_from_the_critic_and_terminated_ones_do_not(model_dir: Path) -> None:
    """Every value is C (zero head weight, bias C), gamma = lam = 1, the reward on the last
    trainable token: a token's advantage is its reward-to-go R plus (next value after the
    episode - C). A truncated episode continues from a state worth C, so its advantage is R; an
    episode the env ended has next value 0, so R - C."""
    value = 0.5
    model, tokenizer = load_policy(model_dir)
    trajectories = synthetic_trajectories(
        model,
        groups=2,
        group_size=4,
        vocab_ids=_vocab(tokenizer),
        first_prompt_len=12,
        observation_len=5,
        turns=(1, 3),
        sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=3),
        seed=21,
    )
    trajectories = [t.model_copy(update={"truncated": i % 2 == 0}) for i, t in enumerate(trajectories)]
    batch = collate(trajectories, tokenizer.pad_token_id)
    batch.turn_rewards = None  # the episode return on the last trainable token
    batch.scores[:] = torch.linspace(0.2, 1.0, batch.size)
    config = _config(advantage="gae", critic={"enabled": True}, whiten_advantages=False)
    updater = PolicyUpdater(model, config)
    assert updater.critic is not None
    with torch.no_grad():
        updater.critic.value_head.bias.fill_(value)
    tokens = batch.response_mask.sum(dim=1)
    terminated = torch.tensor([float(not t.truncated) for t in trajectories])
    expected = float((tokens * (batch.scores - value * terminated)).sum() / tokens.sum())
    assert updater.update(batch)["train/adv_mean"] == pytest.approx(expected, abs=1e-5)


def test_gae_advantages_are_whitened_by_default(model_dir: Path) -> None:
    """Sokoban-like rewards (-0.1 per step, +10 on success): GAE's raw advantages are ~10x GRPO's;
    whitened (the default for gae) they have mean 0 over the batch's trainable tokens."""
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer, seed=23)
    batch.turn_rewards = None
    batch.scores[:] = torch.where(torch.arange(batch.size) % 3 == 0, 10.0, -0.1)

    def adv_mean(**algorithm) -> float:
        fresh, _ = load_policy(model_dir)
        config = _config(advantage="gae", critic={"enabled": True}, **algorithm)
        return PolicyUpdater(fresh, config).update(batch)["train/adv_mean"]

    raw = adv_mean(whiten_advantages=False)
    assert raw > 1.0  # the critic starts at 0: the advantages are the returns
    assert abs(adv_mean()) < 1e-5
    assert abs(adv_mean(whiten_advantages=True)) < 1e-5


def test_critic_final_value_is_the_value_after_the_last_real_token(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([_vocab(tokenizer)[:9]])
    lengths = [5, 8]
    padded = torch.full((2, 8), tokenizer.pad_token_id)
    attention = torch.zeros(2, 8, dtype=torch.long)
    for row, length in enumerate(lengths):
        padded[row, :length] = ids[0, :length]
        attention[row, :length] = 1
    with torch.no_grad():
        final = critic(padded, attention).final_values
        # Causal: V(state after token L-1) is position L of the same row one token longer.
        longer = [
            critic(ids[:, : n + 1], torch.ones(1, n + 1, dtype=torch.long)).values[0, n] for n in lengths
        ]
    torch.testing.assert_close(final, torch.stack(longer), atol=1e-5, rtol=0)


def test_lr_schedules() -> None:
    assert [_lr_multiplier(s, 2, "constant", 10) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = [_lr_multiplier(s, 2, "cosine", 10) for s in range(12)]
    assert cosine[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(cosine[2:]))
    assert cosine[10] == pytest.approx(0.0) and cosine[11] == pytest.approx(0.0)


def test_state_dict_round_trip_through_the_checkpoint_store(model_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    batch = _batch(model, tokenizer, seed=9)
    config = _config(
        advantage="gae", critic={"enabled": True}, optim={"warmup_steps": 3, "schedule": "cosine"}
    )
    updater = PolicyUpdater(model, config)
    updater.update(batch)
    updater.update(batch)
    state = updater.state_dict()
    assert state["step"] == 2 and state["critic"] is not None

    fresh_model, _ = load_policy(model_dir)
    fresh = PolicyUpdater(fresh_model, config)
    fresh.load_state_dict(state)
    assert fresh.step == 2 and fresh.lr == pytest.approx(updater.lr)
    again = fresh.state_dict()
    for key, value in state["optimizer"]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, again["optimizer"]["state"][key][name])
    for key, tensor in state["critic"]["model"].items():
        assert torch.equal(tensor, again["critic"]["model"][key])

    store = CheckpointStore(tmp_path / "run")
    store.save(2, updater.gathered_policy(), tokenizer, **updater.checkpoint_parts())
    restored_model, _ = load_policy(model_dir)
    restored = PolicyUpdater(restored_model, config)
    loaded = store.load(policy=restored.policy, **restored.checkpoint_parts(for_loading=True))
    assert loaded.step == 2 and restored.step == 2
    assert restored.lr == pytest.approx(updater.lr)
    for a, b in zip(restored.policy.parameters(), updater.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    assert restored.critic is not None and updater.critic is not None
    for a, b in zip(restored.critic.parameters(), updater.critic.parameters(), strict=True):
        assert torch.equal(a, b)
    # Both continue identically.
    assert restored.update(batch)["train/pg_loss"] == pytest.approx(updater.update(batch)["train/pg_loss"])


# --- two processes on the gloo backend ---------------------------------------------------------


ALGORITHMS = {
    "grpo": {},
    "gae": {"advantage": "gae", "critic": {"enabled": True}},
    # No entropy bonus: rows of groups that all scored alike skip the policy's passes, so the ranks
    # run different numbers of them.
    "grpo-skip": {"entropy_coef": 0.0},
}
# Rank 1's batch from seed 103 has a group whose rewards are all alike, rank 0's from 102 none.
FIRST_SEED = {"grpo-skip": 102}


# A collective that one rank never joins raises after this instead of waiting gloo's 30 minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# Both ranks load the model, update and save in ~15 s here; the deadline covers a slow CI machine.
SPAWN_DEADLINE_S = 240.0


def _distributed_worker(
    rank: int, world: int, model_dir: str, out_dir: str, parallel: str, algorithm: str
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    model, tokenizer = load_policy(model_dir)
    # Different data on each rank (its own seed, its own groups).
    batch = _batch(model, tokenizer, seed=FIRST_SEED.get(algorithm, 100) + rank, groups=2 + rank)
    config = _config(optim={"micro_batch_tokens": 64}, **ALGORITHMS[algorithm])
    updater = PolicyUpdater(model, config, parallel=parallel)  # type: ignore[arg-type]
    metrics = updater.update(batch)
    state = updater.full_policy_state_dict(rank0_only=False)
    torch.save(
        {"state": {k: v.detach().cpu().clone() for k, v in state.items()}, "metrics": metrics},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    parts = updater.checkpoint_parts()  # a collective: every rank
    policy = updater.gathered_policy()
    if rank == 0:
        assert policy is not None and parts["optimizer"].state_dict()["state"]
        CheckpointStore(Path(out_dir) / "run").save(1, policy, tokenizer, **parts)
    dist.barrier()
    # End the rank without interpreter finalization, where both known torch exit bugs live:
    # destroy_process_group sometimes never returns (pytorch/pytorch#75097; it hung a CI run
    # here), and without it gloo's and autograd's threads release tensors while the interpreter
    # is torn down (pytorch/pytorch#190489; a CI run saw rank 0 die of it with SIGABRT,
    # "malloc(): unaligned tcache chunk detected"). Everything the test reads is on disk now.
    os._exit(0)


def _spawn_ranks(args: tuple, nprocs: int) -> None:
    """``mp.spawn`` with a deadline: on expiry every rank is killed and the test fails, so a
    hung rank can neither outlive the test nor keep pytest from exiting (multiprocessing joins
    live children at interpreter exit)."""
    context = mp.start_processes(_distributed_worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                process.kill()
                process.join(timeout=10)
            pytest.fail(f"ranks {alive} still running after {SPAWN_DEADLINE_S:.0f} s: killed")


@pytest.mark.parametrize(
    ("parallel", "algorithm"), [("fsdp", "grpo"), ("ddp", "grpo"), ("fsdp", "gae"), ("fsdp", "grpo-skip")]
)
def test_two_gloo_processes_end_with_identical_weights(
    model_dir: Path, tmp_path: Path, parallel: str, algorithm: str
) -> None:
    """GAE: the critic's forwards stay in step across ranks with different micro-batch counts,
    and its advantages are whitened with the statistics of both ranks' batches. grpo-skip: the
    policy's passes stay in step when the ranks skip different numbers of rows."""
    args = (2, str(model_dir), str(tmp_path), parallel, algorithm)
    _spawn_ranks(args, nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    initial, tokenizer = load_policy(model_dir)
    initial_state = initial.state_dict()
    changed = 0
    for key, tensor in ranks[0]["state"].items():
        assert torch.equal(tensor, ranks[1]["state"][key]), key
        changed += int(not torch.equal(tensor, initial_state[key]))
    assert changed > 0
    # The ranks saw different data, yet report one global gradient: the one of the union batch
    # (groups stay whole per rank, so GRPO advantages are the same).
    assert ranks[0]["metrics"]["train/grad_norm"] == pytest.approx(ranks[1]["metrics"]["train/grad_norm"])
    single_model, _ = load_policy(model_dir)
    from trainer.batch import collate as collate_all

    union = [
        t
        for rank in range(2)
        for t in synthetic_trajectories(
            single_model,
            groups=2 + rank,
            group_size=4,
            vocab_ids=_vocab(tokenizer),
            first_prompt_len=20,
            observation_len=7,
            turns=(1, 3),
            sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=4),
            seed=FIRST_SEED.get(algorithm, 100) + rank,
        )
    ]
    single = PolicyUpdater(single_model, _config(optim={"micro_batch_tokens": 64}, **ALGORITHMS[algorithm]))
    expected = single.update(collate_all(union, tokenizer.pad_token_id))
    assert ranks[0]["metrics"]["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
    assert ranks[0]["metrics"]["system/update_tokens"] == expected["system/update_tokens"]
    assert ranks[0]["metrics"]["system/update_skipped_rows"] == expected["system/update_skipped_rows"]
    if algorithm == "grpo-skip":
        assert expected["system/update_skipped_rows"] > 0
    assert CheckpointStore(tmp_path / "run").latest() == 1
