"""trainer/update.py on a CUDA GPU: PolicyUpdater.update there computes what it computes on the CPU.

One batch is sampled on the CPU from the tiny policy (real behaviour log-probs, 4 groups sharing
40-token first prompts, so the shared-prefix pass runs; 2 PPO epochs over micro-batches of 64
tokens, so gradients accumulate and the second pass has ratios != 1). The CPU float32 update of it
is the reference for:

* the same update on CUDA with ``bf16: false``: the same metrics, gradients and weights up to
  float32 rounding;
* the update on CUDA with ``bf16: auto`` (bfloat16 autocast there): finite, the weights move, and
  its log-probs and gradients are the reference's up to bfloat16 rounding.

Skipped without a GPU (CI); ``STARGYM_REQUIRE_CUDA=1`` (``deploy/gpu/check_trainer.sh``) turns the
skip into a failure, so a GPU check that ran nothing cannot pass.

Tolerances, measured against the same comparisons on the CPU (float32 with 16 micro-batches vs one:
only the order of the sums differs; bfloat16 autocast on the CPU vs float32), with a margin:

* float32: the first step's gradients (same weights, only rounding) differ by 3e-7 of their norm
  (7e-7 for the worst tensor); the bound is 1e-4 (1e-3 per tensor), which TF32 matmuls should
  not meet (a 10-bit mantissa, ~8x bfloat16's precision, and bfloat16 gives 4e-3). Scalar
  metrics differ by <= 2e-7; the bound is 1e-4 relative + 1e-6. The weights after two AdamW
  steps differ by 6e-5 of the update's norm: Adam's first step is lr x g / (|g| + eps), about
  lr x sign(g), so a gradient element that rounds to the other sign moves its weight by 2 lr;
  the bound is 1e-2 of the update's norm (bfloat16 gives 0.1). ``clipfrac`` may differ by one
  token whose ratio sits on the clip edge.
* bfloat16: log-prob gap to the float32 behaviour log-probs 6e-4 (bound 1e-2); first-step gradients
  4e-3 of their norm (bound 5e-2), grad norm 4e-4 relative (bound 5e-2).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from synthetic import synthetic_trajectories

from deploy.model_init import init_tiny_model
from services.policy import load_policy
from services.rollout_protocol import SamplingParams
from trainer.batch import TrainBatch, collate
from trainer.config import TrainConfig
from trainer.update import PolicyUpdater

REQUIRE_CUDA = os.environ.get("STARGYM_REQUIRE_CUDA") == "1"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not REQUIRE_CUDA,
    reason=f"no CUDA GPU (torch {torch.__version__}); deploy/gpu/check_trainer.sh runs these on one",
)

# By class path, not the registered id: no need for the package's entry points (`pip install -e .`).
FROZENLAKE = "env_server.envs.game.frozenlake:FrozenLakeEnv"
TEMPERATURE = 0.8
LR = 1e-3
# Scalar metrics that must agree between the CPU and CUDA float32 updates.
COMPARED = ("train/pg_loss", "train/entropy", "train/approx_kl", "train/grad_norm", "train/adv_mean")


@pytest.fixture(scope="module", autouse=True)
def _cuda() -> None:
    """Reached without a GPU only under STARGYM_REQUIRE_CUDA=1: fail, do not skip."""
    if not torch.cuda.is_available():
        pytest.fail(
            f"STARGYM_REQUIRE_CUDA=1 but torch {torch.__version__} sees no CUDA GPU "
            f"(built for CUDA {torch.version.cuda})",
            pytrace=False,
        )


def _config(bf16: bool | str) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "rollout": {"sampling": {"temperature": TEMPERATURE, "max_tokens": 4}},
            "algorithm": {"advantage": "grpo", "ppo_epochs": 2, "entropy_coef": 0.01},
            "optim": {"lr": LR, "weight_decay": 0.0, "micro_batch_tokens": 64, "bf16": bf16},
        }
    )


@dataclass
class Updated:
    """What one update did: its metrics, the gradients each optimizer step applied (on the CPU),
    the policy's parameters before and after (on the CPU), and whether it autocast."""

    metrics: dict[str, float]
    grads: list[list[torch.Tensor]]
    before: list[torch.Tensor]
    after: list[torch.Tensor]
    autocast: bool

    def delta(self) -> torch.Tensor:
        return torch.cat([(a - b).flatten() for a, b in zip(self.after, self.before, strict=True)])


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``|value - reference| / |reference|`` in the 2-norm."""
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference))


def _update(model_dir: Path, batch: TrainBatch, device: str, bf16: bool | str) -> Updated:
    model, _ = load_policy(model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    updater = PolicyUpdater(model, _config(bf16), device=device)
    grads: list[list[torch.Tensor]] = []

    def capture(optimizer, args, kwargs) -> None:  # after clipping, before the step
        grads.append([p.grad.detach().cpu().clone() for p in updater.policy.parameters()])

    updater.optimizer.register_step_pre_hook(capture)
    metrics = updater.update(batch)
    after = [p.detach().cpu().clone() for p in updater.policy.parameters()]
    return Updated(metrics, grads, before, after, updater.autocast)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", 0, [FROZENLAKE], 10, 5)


@pytest.fixture(scope="module")
def batch(model_dir: Path) -> TrainBatch:
    """Sampled on the CPU, as the rollout side does; every update moves it to its own device."""
    model, tokenizer = load_policy(model_dir)
    trajectories = synthetic_trajectories(
        model,
        groups=4,
        group_size=4,
        vocab_ids=[i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids],
        first_prompt_len=40,
        observation_len=7,
        turns=(1, 3),
        sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=4),
        seed=0,
    )
    return collate(trajectories, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def cpu_reference(model_dir: Path, batch: TrainBatch) -> Updated:
    reference = _update(model_dir, batch, "cpu", bf16=False)  # "auto" autocasts on an AMX CPU
    assert reference.metrics["system/micro_batches"] > 1
    assert len(reference.grads) == 2  # one optimizer step per PPO epoch
    return reference


def test_float32_update_on_cuda_matches_the_cpu(
    model_dir: Path, batch: TrainBatch, cpu_reference: Updated
) -> None:
    cuda = _update(model_dir, batch, "cuda", bf16=False)
    assert not cuda.autocast
    expected, got = cpu_reference.metrics, cuda.metrics
    for name in COMPARED:
        assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    # The behaviour log-probs were sampled on the CPU: recomputed on the GPU they are the same.
    assert got["rollout/logprob_gap"] < 1e-4
    assert abs(got["train/clipfrac"] - expected["train/clipfrac"]) <= 1.0 / batch.num_trainable_tokens
    for name in ("system/micro_batches", "system/update_tokens", "train/skipped_steps"):
        assert got[name] == expected[name], name

    assert len(cuda.grads) == len(cpu_reference.grads) == 2
    first_cuda, first_cpu = cuda.grads[0], cpu_reference.grads[0]
    assert float(_flat(first_cpu).abs().sum()) > 0
    assert _relative(_flat(first_cuda), _flat(first_cpu)) < 1e-4
    for index, (g_cuda, g_cpu) in enumerate(zip(first_cuda, first_cpu, strict=True)):
        if float(g_cpu.abs().sum()) > 0:
            assert _relative(g_cuda, g_cpu) < 1e-3, f"parameter {index}"
        else:  # rows of tokens the batch never uses get no gradient on either device
            assert float(g_cuda.abs().sum()) == 0.0, f"parameter {index}"

    assert _relative(cuda.delta(), cpu_reference.delta()) < 1e-2
    assert all(bool(torch.isfinite(p).all()) for p in cuda.after)


def test_bf16_autocast_update_on_cuda_is_finite_and_moves_the_weights(
    model_dir: Path, batch: TrainBatch, cpu_reference: Updated
) -> None:
    bf16 = _update(model_dir, batch, "cuda", bf16="auto")
    assert bf16.autocast  # "auto" autocasts on a GPU
    metrics = bf16.metrics
    for name, value in metrics.items():
        assert math.isfinite(value), name
    assert metrics["train/skipped_steps"] == 0.0  # both steps had a finite gradient norm
    assert metrics["train/grad_norm"] > 0
    assert all(bool(torch.isfinite(p).all()) for p in bf16.after)
    moved = bf16.delta()
    assert float((moved != 0).float().mean()) > 0.5, "most weights should take an AdamW step"
    # The parameters stay float32 (autocast computes in bfloat16, Adam updates float32 weights).
    assert all(p.dtype == torch.float32 for p in bf16.after)

    # bfloat16 rounding, not a different computation: close to the float32 reference.
    assert metrics["rollout/logprob_gap"] < 1e-2
    reference = cpu_reference.metrics
    assert metrics["train/entropy"] == pytest.approx(reference["train/entropy"], rel=1e-2)
    assert metrics["train/grad_norm"] == pytest.approx(reference["train/grad_norm"], rel=5e-2)
    assert _relative(_flat(bf16.grads[0]), _flat(cpu_reference.grads[0])) < 5e-2
