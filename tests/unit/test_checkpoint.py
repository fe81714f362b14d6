"""Checkpoints: atomic save, full restore (weights, optimizer, RNG, state), pruning, publishing."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy.tiny_model import build_model, build_tokenizer
from services.policy import load_policy
from trainer.checkpoint import CheckpointNotFound, CheckpointStore, capture_rng_states, restore_rng_states

TEXTS = ["Reach G and avoid O.", "P _ _\n_ O G"]
ACTIONS = ["Left", "Right"]
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, ACTIONS)


def make_training(tokenizer, seed: int):
    model = build_model(tokenizer, seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, vocab: int) -> None:
    """One update on a batch drawn from the global torch RNG, so RNG restoration matters too."""
    ids = torch.randint(0, vocab, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def params(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_round_trip_continues_exactly_as_without_a_reload(tmp_path: Path, tokenizer) -> None:
    vocab = len(tokenizer)
    torch.manual_seed(0)
    model, optimizer, scheduler = make_training(tokenizer, seed=0)
    for _ in range(2):
        train_step(model, optimizer, scheduler, vocab)
    store = CheckpointStore(tmp_path, keep_last=2)
    curriculum = {"stage": 1, "max_turns": 13}
    controller = {"issued": 96, "pending_acks": ["1-0", "2-0"], "rng": [1, 2, 3]}
    path = store.save(
        2,
        model,
        tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        curriculum_state=curriculum,
        controller_state=controller,
        extra={"policy_version": 2},
    )
    assert path == tmp_path / "step-2" and store.latest() == 2
    snapshot = capture_rng_states()
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng_states(snapshot)
    train_step(model, optimizer, scheduler, vocab)  # the step without a reload
    expected = params(model)
    expected_lr = scheduler.get_last_lr()

    # scramble everything, then restore into fresh objects
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    fresh, fresh_optimizer, fresh_scheduler = make_training(tokenizer, seed=99)
    loaded = CheckpointStore(tmp_path, keep_last=2).load(
        policy=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler
    )
    assert loaded.step == 2 and loaded.policy_dir == path / "policy"
    assert loaded.curriculum_state == curriculum and loaded.controller_state == controller
    assert loaded.extra == {"policy_version": 2}
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])

    restore_rng_states(snapshot)  # undo the draws: the batch below must see the saved RNG state
    train_step(fresh, fresh_optimizer, fresh_scheduler, vocab)
    got = params(fresh)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert fresh_scheduler.get_last_lr() == expected_lr


def test_policy_dir_of_a_checkpoint_is_a_hugging_face_model(tmp_path: Path, tokenizer) -> None:
    model = build_model(tokenizer, 3)
    store = CheckpointStore(tmp_path)
    store.save(5, model, tokenizer)
    loaded = store.load(5, restore_rng=False)
    reloaded, _ = load_policy(loaded.policy_dir)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert (loaded.path / "state.json").is_file() and not (loaded.path / "optimizer.pt").exists()
    with pytest.raises(CheckpointNotFound, match=r"optimizer\.pt"):
        store.load(5, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_keep_last_deletes_older_checkpoints(tmp_path: Path, tokenizer) -> None:
    model = build_model(tokenizer, 0)
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        store.save(step, model, tokenizer)
    assert store.steps() == [30, 40]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-30", "step-40"]
    store.save(40, model, tokenizer)  # saving a step again replaces it
    assert store.steps() == [30, 40]


def test_empty_store(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run")
    assert store.latest() is None and store.steps() == [] and store.latest_policy() is None
    with pytest.raises(CheckpointNotFound):
        store.load()
    with pytest.raises(CheckpointNotFound):
        store.load(3)
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep_last=0)


def test_state_must_be_json(tmp_path: Path, tokenizer) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(TypeError):
        store.save(1, build_model(tokenizer, 0), tokenizer, controller_state={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_failure_before_the_rename_keeps_the_previous_checkpoint(tmp_path: Path, tokenizer) -> None:
    model = build_model(tokenizer, 0)
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(1, model, tokenizer, controller_state={"step": 1})

    def crash(staging: Path) -> None:
        assert (staging / "state.json").is_file()  # fully written, not yet renamed
        raise RuntimeError("simulated crash")

    store.before_commit = crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        store.save(2, model, tokenizer, controller_state={"step": 2})
    assert store.latest() == 1
    assert store.load(restore_rng=False).controller_state == {"step": 1}
    assert [path.name for path in tmp_path.iterdir()] == ["step-1"]  # keep_last did not run


def test_sigkill_mid_save_leaves_latest_on_the_good_checkpoint(tmp_path: Path, tokenizer) -> None:
    """A real crash: the process dies between writing the checkpoint and renaming it."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from deploy.tiny_model import build_model, build_tokenizer
        from trainer.checkpoint import CheckpointStore
        tokenizer = build_tokenizer({TEXTS!r}, {ACTIONS!r})
        model = build_model(tokenizer, 0)
        store = CheckpointStore({str(tmp_path)!r}, keep_last=1)
        store.save(1, model, tokenizer)
        store.before_commit = lambda staging: os.kill(os.getpid(), signal.SIGKILL)
        store.save(2, model, tokenizer)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names[0].startswith(".step-2.tmp-") and names[1:] == ["step-1"]
    store = CheckpointStore(tmp_path, keep_last=1)  # the next start cleans up
    assert store.removed_strays == [names[0]]
    assert store.latest() == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-1"]
    store.load(policy=build_model(tokenizer, 7), restore_rng=False)


def test_stray_temp_dirs_of_policies_are_cleaned_too(tmp_path: Path) -> None:
    for name in (".policy-v3.tmp-abc", ".policy-v2.old-x", ".step-4.del-y", "step-9", "notes"):
        (tmp_path / name).mkdir()
    store = CheckpointStore(tmp_path)
    assert store.removed_strays == [".policy-v2.old-x", ".policy-v3.tmp-abc", ".step-4.del-y"]
    assert store.latest() is None  # step-9 has no state.json: not a checkpoint
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes", "step-9"]


def test_a_read_only_store_never_removes_what_a_save_in_progress_wrote(tmp_path: Path) -> None:
    # A trainer rank other than 0 opens the run dir while rank 0 may be mid-save.
    (tmp_path / ".step-4.tmp-abc").mkdir()
    store = CheckpointStore(tmp_path, read_only=True)
    assert store.removed_strays == [] and (tmp_path / ".step-4.tmp-abc").is_dir()


def test_published_policies_load_with_auto_model(tmp_path: Path, tokenizer) -> None:
    store = CheckpointStore(tmp_path, keep_policies=2)
    models = {version: build_model(tokenizer, version) for version in range(4)}
    for version, model in models.items():
        path = store.publish_policy(version, model, tokenizer)
        assert path == (tmp_path / f"policy-v{version}").resolve()
    assert store.latest_policy() == (3, tmp_path.resolve() / "policy-v3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2", "policy-v3"]
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "policy-v3")
    assert torch.equal(auto.lm_head.weight, models[3].lm_head.weight)
    assert (tmp_path / "policy-v3" / "model.safetensors").is_file()


def test_rng_states_round_trip_through_json_free_files(tmp_path: Path) -> None:
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    states = capture_rng_states()
    torch.save(states, tmp_path / "rng.pt")
    first = (random.random(), np.random.normal(), torch.randn(2))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    second = (random.random(), np.random.normal(), torch.randn(2))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    assert json.dumps(states["python"]["state"][:3])  # plain ints
